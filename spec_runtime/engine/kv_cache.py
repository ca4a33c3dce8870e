"""The KV pool: one row per token, per layer, shared by every request.

Row r of layer l is `k_cache[l][r]` / `v_cache[l][r]`, each [num_kv_heads, head_dim].
Which rows belong to which sequence is decided by `SlotLayout` (forward_batch.py);
this class only owns the memory. The per-layer tensors are [num_rows, H, D] so the
CUDA backend can view them as NHD pages of size 1 ([num_rows, 1, H, D]) with no copy.
"""

from __future__ import annotations

import torch

from spec_runtime.models.hf_config import ModelArch


class KVCache:
    """Per-layer key and value tensors [num_rows, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_rows", num_rows),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_rows = num_rows
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Zeros, not empty: padded attention reads row 0 of unwritten pools, and a NaN
        # there would survive masking (0 * NaN) in the value product.
        storage = torch.zeros(
            2, num_layers, num_rows, num_kv_heads, head_dim, dtype=dtype, device=self.device
        )  # [2, L, rows, H, D]
        self._storage = storage
        self.k_cache: list[torch.Tensor] = list(storage[0].unbind(0))  # L x [rows, H, D]
        self.v_cache: list[torch.Tensor] = list(storage[1].unbind(0))  # L x [rows, H, D]

    @property
    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, rows={self.num_rows}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )


def kv_bytes_per_token(arch: ModelArch, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one token's K and V take over all layers (on one of tp_size ranks)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * arch.num_layers * (arch.num_kv_heads // tp_size) * arch.head_dim * elem
