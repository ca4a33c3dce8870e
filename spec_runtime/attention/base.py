"""The attention seam: write the new tokens' K/V into the pool, then attend.

A backend sees each forward twice: `begin(batch)` once (planning that every layer
shares: index tensors, masks, kernel plans), then per layer either `forward` (write
the step's K/V, then attend) or `attend` (the K/V rows are already written, e.g. by
the fused RoPE kernel). The rule is forward_batch.py's causal bottom-right alignment:
query i of a request with q new tokens and n kv rows sees its rows [0, n - q + i].
Every backend serves every kind of step: prefill, decode, verify, and tree steps
(ForwardBatch.tree: each token sees its request's shared prefix plus its own window).

A backend that can run inside CUDA graphs also makes each captured shape's
`GraphAttention` and readies it before each replay (`make_graph_attention`,
`begin_graph`); engine/cuda_graphs.py drives them without knowing the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # types only: the engine's data structures, which the engine hands in
    from spec_runtime.engine.forward_batch import ForwardBatch
    from spec_runtime.engine.kv_cache import KVCache


@dataclass
class GraphAttention:
    """The attention of one captured (batch_size, q_len) shape.

    host_plan: whether `begin_graph` needs the padded kv_indptr on the host (a backend
    that plans on the host before each replay); otherwise the captured kernels read the
    static batch's device tensors, which the graph runner refills.
    """

    batch_size: int
    q_len: int
    max_kv_rows: int  # total kv rows over the batch the index buffer holds
    host_plan: bool = False


class AttentionBackend(ABC):
    """Attention over the KV pool for one ForwardBatch."""

    @abstractmethod
    def begin(self, batch: ForwardBatch) -> None:
        """Plan the forward of `batch`; called once before the first layer."""

    @abstractmethod
    def attend(self, layer_idx: int, q: torch.Tensor, kv: KVCache, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the pool, whose rows for the step's tokens
        (batch.kv_write_rows) are already written; returns [T, Hq, D]."""

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv: KVCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write k/v into rows batch.kv_write_rows of layer `layer_idx`, then attend
        (under batch.tree's shared-prefix mask when it is set)."""
        # index_copy_ with a device index: no host sync, one kernel per tensor.
        kv.k_cache[layer_idx].index_copy_(0, batch.kv_write_rows, k)
        kv.v_cache[layer_idx].index_copy_(0, batch.kv_write_rows, v)
        return self.attend(layer_idx, q, kv, batch)

    def supports_tree(self, q_len: int) -> bool:
        """Whether a tree step (ForwardBatch.tree) of q_len branches per request can run."""
        return True

    def warm_up(self, trees: bool) -> None:
        """Compile the kernel variants forwards can meet (trees: tree steps' too) now, not in
        the step that first meets one. Nothing to compile here."""

    def make_graph_attention(self, batch_size: int, q_len: int, max_kv_rows: int,
                             tree: bool = False) -> GraphAttention:
        """The attention of a CUDA graph for `batch_size` requests of `q_len` tokens each."""
        raise NotImplementedError(f"{type(self).__name__} does not run inside CUDA graphs")

    def begin_graph(self, ga: GraphAttention, kv_indptr_cpu: np.ndarray | None, kv_indices: torch.Tensor | None,
                    batch: ForwardBatch, num_kv_rows: int) -> None:
        """Get a graph's attention ready for `num_kv_rows` kv rows over its padded
        requests; kv_indptr_cpu [B+1] and kv_indices are given where ga.host_plan."""
        raise NotImplementedError(f"{type(self).__name__} does not run inside CUDA graphs")
