"""The vocabulary embedding and the LM head.

A model with tied embeddings has no LM head of its own: its logits are the
embedding's `logits` (the same weight read as the output projection). On the CPU both
can run the output projection over a oneDNN-packed copy (`pack_for_cpu`, layers/linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_runtime.layers.linear import pack_weight, project


def _vocab_weight(vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))  # the whole vocabulary on every rank


class VocabEmbedding(nn.Module):
    """token ids [T] -> [T, H]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _vocab_weight(vocab_size, hidden_size, dtype)
        self.packed_weight: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def pack_for_cpu(self) -> None:
        """Compute `logits` over a oneDNN-packed copy; the lookups keep the plain weight."""
        self.packed_weight = pack_weight(self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (tied LM head)."""
        return project(hidden, self.weight, self.packed_weight).float()


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] float32, with a weight of its own."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _vocab_weight(vocab_size, hidden_size, dtype)
        self.packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Compute `logits` over a oneDNN-packed copy; the plain weight is released."""
        self.packed_weight = pack_weight(self.weight)
        self.weight = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(hidden, self.weight, self.packed_weight).float()
