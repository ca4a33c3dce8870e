"""The seam between the draft worker and what produces speculations.

Two implementations: `ModelDrafter` (a draft model, chain decoding of K tokens) and
`NgramSpeculator` (prompt lookup, no model). SSD's tree cache sits in front of a
ModelDrafter and uses one of them as its backup on a miss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from draft_proc.state import DraftSeq
from protocol.sparse_q import DraftTokens


class Speculator(ABC):
    @abstractmethod
    def propose(self, seqs: list[DraftSeq], k: int) -> list[DraftTokens]:
        """Draft up to k tokens after each sequence's confirmed tokens (one DraftTokens per
        sequence, q absent for a greedy draft) and record the speculation in each
        DraftSeq (set_speculation)."""

    def add(self, seq: DraftSeq) -> None:  # noqa: B027 - optional hook
        """A new sequence (its prompt is prefilled lazily, with its first propose)."""

    def release(self, seq: DraftSeq) -> None:  # noqa: B027 - optional hook
        """The sequence is gone."""

    def keep_up(self, seqs: list[DraftSeq]) -> None:  # noqa: B027 - optional hook
        """Outcomes that asked for no answer (plain steps) moved these sequences on: compute
        what the next propose would otherwise catch up on first."""
