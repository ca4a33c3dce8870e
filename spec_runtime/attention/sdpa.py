"""The CPU attention backend: padded, masked torch SDPA over gathered pool rows.

The R ragged requests of a batch are padded into one [R, max_q] x [R, max_kv] torch
SDPA call with a boolean mask, so a layer costs one gather and one attention call
however many requests the batch holds. The mask is base.py's rule (causal,
bottom-right), a tree step's shared prefix plus per-token window, or, for a model
with a sliding window (Mistral), causal within the window: a token at position p
sees positions (p - sliding_window, p].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from spec_runtime.attention.base import AttentionBackend

if TYPE_CHECKING:  # types only: the engine's data structures, which the engine hands in
    from spec_runtime.engine.forward_batch import ForwardBatch
    from spec_runtime.engine.kv_cache import KVCache


@dataclass
class _SDPAPlan:
    q_index: torch.Tensor  # [R, max_q] int64: token index of each padded query (0 where padding)
    q_valid: torch.Tensor  # [R, max_q] bool
    kv_rows: torch.Tensor  # [R, max_kv] int64: pool row of each padded key (row 0 where padding)
    mask: torch.Tensor  # [R, 1, max_q, max_kv] bool: True = may attend


def write_kv(kv: KVCache, layer_idx: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, Hkv, D]) at pool rows `rows` ([T])."""
    kv.k_cache[layer_idx][rows] = k
    kv.v_cache[layer_idx][rows] = v


class SDPABackend(AttentionBackend):
    """Padded, masked torch SDPA over gathered pool rows (CPU reference backend)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self._plan: _SDPAPlan | None = None
        self._plan_batch: ForwardBatch | None = None

    def begin(self, batch: ForwardBatch) -> None:
        qo = batch.qo_indptr_cpu.astype(np.int64)  # [R+1]
        kvp = batch.kv_indptr_cpu.astype(np.int64)  # [R+1]
        q_lens = np.diff(qo)  # [R]
        kv_lens = np.diff(kvp)  # [R]
        if (kv_lens < q_lens).any():
            raise ValueError("every request needs at least as many kv rows as new tokens")
        max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
        i = np.arange(max_q)
        j = np.arange(max_kv)
        q_valid = i[None, :] < q_lens[:, None]  # [R, max_q]
        q_index = np.where(q_valid, qo[:-1, None] + i[None, :], 0)  # [R, max_q]
        kv_valid = j[None, :] < kv_lens[:, None]  # [R, max_kv]
        kv_pos = np.where(kv_valid, kvp[:-1, None] + j[None, :], 0)  # [R, max_kv] into kv_indices
        # Bottom-right causal: query i sees key j iff j <= n - q + i. Padded queries
        # (i >= q) see every real key, so no mask row is empty (an empty row gives NaN).
        if batch.tree is None:
            last_visible = (kv_lens - q_lens)[:, None, None] + i[None, :, None]  # [R, max_q, 1]
            seen = j[None, None, :] <= last_visible
            if self.sliding_window is not None:
                # A request's kv rows are its positions 0..n-1 in order, so j is a position.
                # Padded queries' rows keep their last real key visible (no empty row).
                seen &= j[None, None, :] > np.minimum(last_visible, kv_lens[:, None, None] - 1) - self.sliding_window
            mask = kv_valid[:, None, :] & seen  # [R, max_q, max_kv]
        else:
            if self.sliding_window is not None:
                raise ValueError("tree steps are not supported for a model with a sliding window")
            # Tree step: the request's prefix, then the token's own window [lo, hi).
            tr = batch.tree
            lo = np.where(q_valid, tr.lo_cpu[q_index], 0)[:, :, None]  # [R, max_q, 1]
            hi = np.where(q_valid, tr.hi_cpu[q_index], max_kv)[:, :, None]
            jj = j[None, None, :]
            seen = (jj < tr.prefix_len_cpu[:, None, None]) | ((jj >= lo) & (jj < hi))
            mask = kv_valid[:, None, :] & seen  # [R, max_q, max_kv]

        dev = batch.kv_indices.device
        kv_pos_t = torch.from_numpy(kv_pos).to(dev, non_blocking=True)
        self._plan = _SDPAPlan(
            q_index=torch.from_numpy(q_index).to(dev, non_blocking=True),
            q_valid=torch.from_numpy(q_valid).to(dev, non_blocking=True),
            kv_rows=batch.kv_indices.to(torch.int64)[kv_pos_t],
            mask=torch.from_numpy(mask).to(dev, non_blocking=True).unsqueeze(1),
        )
        self._plan_batch = batch

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                batch: ForwardBatch) -> torch.Tensor:
        self._check(batch)
        write_kv(kv, layer_idx, k, v, batch.kv_write_rows)
        return self.attend(layer_idx, q, kv, batch)

    def _check(self, batch: ForwardBatch) -> None:
        if self._plan is None or self._plan_batch is not batch:
            raise ValueError("SDPABackend.begin(batch) must be called before forward for that batch")

    def attend(self, layer_idx: int, q: torch.Tensor, kv: KVCache, batch: ForwardBatch) -> torch.Tensor:
        self._check(batch)
        plan = self._plan
        qp = q[plan.q_index].transpose(1, 2)  # [R, Hq, max_q, D]
        kp = kv.k_cache[layer_idx][plan.kv_rows].transpose(1, 2)  # [R, Hkv, max_kv, D]
        vp = kv.v_cache[layer_idx][plan.kv_rows].transpose(1, 2)  # [R, Hkv, max_kv, D]
        out = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=plan.mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [R, Hq, max_q, D]
        # Boolean indexing walks [R, max_q] row-major, which is the token order of q.
        return out.transpose(1, 2)[plan.q_valid]  # [T, Hq, D]
