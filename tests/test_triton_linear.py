"""triton_linear.small_linear on the CPU under Triton's interpreter, against the eager
ops it replaces (cuda_ops' RMSNorm and SiLU-and-mul, F.linear, a bf16 residual add),
for sizes that are not multiples of the blocks and every fusion. tests/test_gpu.py checks the whole
forward with it on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from spec_runtime.model.cuda_ops import _rmsnorm, _silu_mul  # noqa: E402
from spec_runtime.model.triton_linear import MAX_ROWS, small_linear  # noqa: E402


def _data(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    return x, w, g


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-2) -> None:
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.3g}"


@pytest.mark.parametrize("n,k", [(40, 96), (16, 64)])
def test_plain_and_bias(n: int, k: int) -> None:
    x, w, g = _data(1, n, k)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    _close(small_linear(x, w), F.linear(x.float(), w.float()))
    _close(small_linear(x, w, bias=bias), F.linear(x.float(), w.float(), bias.float()))


def test_norm_prologue() -> None:
    x, w, g = _data(1, 72, 200, seed=1)
    nw = (1 + 0.3 * torch.randn(200, generator=g)).to(torch.bfloat16)
    want = F.linear(_rmsnorm(x, nw, 1e-5).float(), w.float())
    _close(small_linear(x, w, norm_weight=nw, eps=1e-5), want)


def test_norm_and_silu_mul() -> None:
    inter, k = 48, 80
    x, w, g = _data(1, 2 * inter, k, seed=2)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(torch.bfloat16)
    want = _silu_mul(F.linear(_rmsnorm(x, nw, 1e-6).float(), w.float()))
    got = small_linear(x, w, norm_weight=nw, eps=1e-6, silu_mul=True)
    assert got.shape == (1, inter)
    _close(got, want)


def test_residual_add_in_place() -> None:
    x, w, g = _data(1, 56, 130, seed=3)
    residual = (torch.randn(1, 56, generator=g) * 4).to(torch.bfloat16)
    want = residual.float() + F.linear(x.float(), w.float())
    out = small_linear(x, w, add_to=residual)
    assert out.data_ptr() == residual.data_ptr()
    _close(residual, want, tol=1e-2)


def test_wrong_shapes_are_refused() -> None:
    x, w, _ = _data(1, 32, 64)
    with pytest.raises(ValueError, match="at most"):
        small_linear(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="does not take"):
        small_linear(x, w[:, :32])
    with pytest.raises(ValueError, match="add_to"):
        small_linear(x, w, add_to=torch.zeros(1, 31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="silu_mul"):
        small_linear(x, w, silu_mul=True, add_to=torch.zeros(1, 16, dtype=torch.bfloat16))
