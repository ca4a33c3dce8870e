"""Rotary position embedding (half-split layout, as transformers), with Llama 3.1 scaling.

cos/sin are computed in float32 from the positions of the step, then cast to the
model dtype, as transformers does, so float32 logits match it to ~1e-5.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from spec_runtime.kernels.compiled import compiled
from spec_runtime.kernels.plan import KernelPlan


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """[D/2] float32 inverse frequencies. scaling: a Llama 3.1 scaling (factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings) or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    s = scaling
    if s is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, 1, D] in `dtype`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2] fp32
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """The step's cos/sin tables; one compiled kernel when the plan is fused.

    The inverse frequencies are a plain attribute, not a buffer (`to_empty` would wipe
    a buffer): call `init_tables(device)` once the model is on its device.
    """

    def __init__(self, head_dim: int, theta: float, scaling, plan: KernelPlan) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.plan = plan
        self.inv_freq: torch.Tensor | None = None

    def init_tables(self, device: torch.device | str) -> None:
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)  # [D/2] fp32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D]."""
        fn = compiled(rope_cos_sin) if self.plan.fused else rope_cos_sin
        return fn(positions, self.inv_freq, dtype)
