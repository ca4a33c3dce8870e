"""The spec link of a target without a draft process (AR mode).

Same interface as `DraftLink`, doing nothing: the worker runs one plan whether or not a
draft exists, and every step is a plain decode.
"""

from __future__ import annotations

from typing import Any, Callable

from protocol.sparse_q import DraftTokens
from target_proc.outputs import draft_fields
from target_proc.sequence import Sequence


class NoDraft:
    present = False
    alive = False

    def check(self) -> None:
        pass

    def admit(self, seqs: list[Sequence]) -> None:
        pass

    def send_first_tokens(self, seqs: list[Sequence]) -> None:
        pass

    def collect(self, seqs: list[Sequence]) -> dict[int, DraftTokens]:
        return {}

    def send_outcomes(self, seqs: list[Sequence], specs: dict[int, DraftTokens], num_accepted: list[int],
                      token_ids: list[list[int]], speculated: bool, choose_work_ahead: Callable[[int], Any]) -> Any:
        return True

    def finish(self, seq_id: int) -> None:
        pass

    def preempt(self, seq_id: int) -> None:
        pass

    def take_draft_work_s(self) -> float:
        return 0.0

    def engine_fields(self) -> dict:
        return draft_fields(None)
