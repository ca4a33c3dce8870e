"""Attention over the KV pool: one interface (base.AttentionBackend), a CPU backend
(sdpa.SDPABackend) and a CUDA one (cuda.CudaAttentionBackend: Triton paged attention
and flashinfer). `make_backend` picks by device; callers never ask which they got."""

from __future__ import annotations

from spec_runtime.attention.base import AttentionBackend, GraphAttention
from spec_runtime.attention.sdpa import SDPABackend


def make_backend(num_heads: int, num_kv_heads: int, head_dim: int, dtype, device, *,
                 sliding_window: int | None = None, graph_attention: str = "triton") -> AttentionBackend:
    """SDPA on CPU; on CUDA the Triton/flashinfer backend (graph_attention: which serves
    short uniform forwards and CUDA graphs)."""
    import torch

    if torch.device(device).type == "cpu":
        return SDPABackend(num_heads, num_kv_heads, head_dim, sliding_window=sliding_window)
    if sliding_window is not None:
        raise ValueError("sliding-window attention (Mistral) runs on CPU only: the CUDA kernels attend to the "
                         "whole context")
    from spec_runtime.attention.cuda import CudaAttentionBackend

    return CudaAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, device, graph_attention=graph_attention)


__all__ = ["AttentionBackend", "GraphAttention", "SDPABackend", "make_backend"]
