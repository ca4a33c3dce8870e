"""The draft's view of one sequence, and how an outcome moves it forward.

Pure CPU bookkeeping, no torch. For sequence x_1..x_n (x_n = the target's last
recovery/bonus token) the draft's KV rows are valid for positions [0, num_cached) of
`token_ids + draft_token_ids`; a rejected draft token is undone by lowering num_cached
(moving the length), never by copying.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class OutcomeError(ValueError):
    """An outcome that does not fit the draft's state (the target will re-add the sequence)."""


@dataclass
class DraftSeq:
    seq_id: int
    slot: int  # index among the draft's sequences: its SSD scratch rows (and its slot in a slot layout)
    token_ids: list[int]  # confirmed tokens x_1..x_n
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_cached: int = 0
    # The speculation last returned for this sequence (d_1..d_m).
    draft_token_ids: list[int] = field(default_factory=list)
    round: int = 0
    # Whether a speculation is outstanding (the next outcome refers to it).
    awaiting_outcome: bool = False
    # SSD: whether the last look-up missed (selects the miss fan-out).
    last_missed: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def apply_outcome(self, num_accepted: int, token_id: int, seq_len: int, round_: int) -> None:
        """x_1..x_n, d_1..d_m + outcome (j, t) -> x_1..x_n, d_1..d_j, t."""
        m = len(self.draft_token_ids) if self.awaiting_outcome else 0
        if not 0 <= num_accepted <= m:
            raise OutcomeError(f"num_accepted={num_accepted} but the draft proposed {m} tokens")
        new_len = self.num_tokens + num_accepted + 1
        if seq_len != new_len:
            raise OutcomeError(f"seq_len={seq_len} but the draft's bookkeeping gives {new_len}")
        n = self.num_tokens
        self.num_cached = min(self.num_cached, n + num_accepted)
        self.token_ids.extend(self.draft_token_ids[:num_accepted])
        self.token_ids.append(token_id)
        self.draft_token_ids = []
        self.awaiting_outcome = False
        self.round = round_

    def set_speculation(self, draft_token_ids: list[int], num_cached: int) -> None:
        self.draft_token_ids = list(draft_token_ids)
        self.num_cached = num_cached
        self.awaiting_outcome = True

    def set_no_speculation(self) -> None:
        """An outstanding speculation of no tokens (the next outcome is (0, t)); KV stays
        valid at most up to the token before the last, which the next forward feeds."""
        self.set_speculation([], num_cached=min(self.num_cached, self.num_tokens - 1))
