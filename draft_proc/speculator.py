"""The seam between the draft worker and what produces speculations.

Two implementations: `ModelDrafter` (a draft model, chain decoding of K tokens) and
`NgramSpeculator` (prompt lookup, no model). SSD's tree cache sits in front of a
ModelDrafter and uses one of them as its backup on a miss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from draft_proc.state import DraftSeq
from protocol.messages import PLACEHOLDER_TOKEN_ID


@dataclass
class Proposal:
    """Speculations for a batch, in the SpecResponse layout."""

    draft_token_ids: np.ndarray  # [B, K] int64, PLACEHOLDER_TOKEN_ID past num_draft_tokens
    num_draft_tokens: np.ndarray  # [B] int32
    q_token_ids: np.ndarray | None = None  # [B, K, top_k] int64; None when every row is greedy
    q_probs: np.ndarray | None = None  # [B, K, top_k] float32

    @staticmethod
    def empty(batch: int, k: int) -> "Proposal":
        return Proposal(
            draft_token_ids=np.full((batch, k), PLACEHOLDER_TOKEN_ID, dtype=np.int64),
            num_draft_tokens=np.zeros(batch, dtype=np.int32),
        )


class Speculator(ABC):
    @abstractmethod
    def propose(self, seqs: list[DraftSeq], k: int) -> Proposal:
        """Draft up to k tokens after each sequence's confirmed tokens and record the
        speculation in each DraftSeq (set_speculation)."""

    def add(self, seq: DraftSeq) -> None:  # noqa: B027 - optional hook
        """A new sequence (its prompt is prefilled lazily, with its first propose)."""

    def release(self, seq: DraftSeq) -> None:  # noqa: B027 - optional hook
        """The sequence is gone."""
