"""The vocabulary embedding and the LM head.

A model with tied embeddings has no LM head of its own: its logits are the
embedding's `logits` (the same weight read as the output projection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _vocab_weight(vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))  # the whole vocabulary on every rank


class VocabEmbedding(nn.Module):
    """token ids [T] -> [T, H]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _vocab_weight(vocab_size, hidden_size, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (tied LM head)."""
        return F.linear(hidden, self.weight).float()


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] float32, with a weight of its own."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _vocab_weight(vocab_size, hidden_size, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
