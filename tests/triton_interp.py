"""Run this repository's Triton kernels on the CPU with Triton's interpreter.

Import this module before `spec_runtime.kernels.paged` (it sets
TRITON_INTERPRET=1, which Triton reads at import). It also works around an
interpreter bug under NumPy 2: a loaded scalar is a 1-element array, and
`range(lo, hi)` over such scalars calls int() on it, which NumPy 2 refuses.
"""

from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import numpy as np  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

_orig_patch_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _orig_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor
