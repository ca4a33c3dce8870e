"""torch.compile'd versions of the layers' small ops (RMSNorm, SiLU-and-mul, RoPE tables).

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
