"""The layers' handles on the fused kernels: torch.compile'd versions of their small ops
(RMSNorm, SiLU-and-mul, RoPE tables), and the Triton kernels imported on first use.

Each is one Triton kernel made by torch.compile from the eager function it wraps, so
the math is the layer's own. Compilation is lazy (first call), and `dynamic=True`
makes one kernel per op for every token count and model width instead of a
recompile per captured batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


@functools.cache
def compiled(fn: Callable) -> Callable:
    """The compiled version of `fn`, made once per process."""
    import torch

    return torch.compile(fn, dynamic=True, fullgraph=True)


@functools.cache
def triton_kernels():
    """The Triton kernels the layers call, imported on first use: Triton is a CUDA-host
    dependency, and the tests pick its interpreter before it is first imported. Returns
    a namespace with rope_store_kv and small_linear."""
    from types import SimpleNamespace

    from spec_runtime.kernels.paged import rope_store_kv
    from spec_runtime.kernels.small_linear import small_linear

    return SimpleNamespace(rope_store_kv=rope_store_kv, small_linear=small_linear)
