"""RMSNorm, optionally with the residual add before it.

Numerics follow transformers: the statistics in float32, the normalised value rounded
to the input dtype before the weight multiplies it; the residual stream stays in the
input dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from spec_runtime.kernels.compiled import compiled
from spec_runtime.kernels.plan import KernelPlan


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; one compiled kernel (with the add) when the plan is fused."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, plan: KernelPlan) -> None:
        super().__init__()
        self.eps = eps
        self.plan = plan
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> rms_norm(x); with residual: (rms_norm(x + residual), x + residual)."""
        fused = self.plan.fused
        if residual is None:
            return (compiled(rms_norm) if fused else rms_norm)(x, self.weight, self.eps)
        return (compiled(add_rms_norm) if fused else add_rms_norm)(x, residual, self.weight, self.eps)
