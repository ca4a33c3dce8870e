"""SiLU-and-mul: the gated MLP activation over a fused [gate; up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_runtime.kernels.compiled import compiled
from spec_runtime.kernels.plan import KernelPlan


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up, [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu_mul; one compiled kernel when the plan is fused."""

    def __init__(self, plan: KernelPlan) -> None:
        super().__init__()
        self.plan = plan

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return (compiled(silu_mul) if self.plan.fused else silu_mul)(gate_up)
