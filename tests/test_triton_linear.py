"""The one-token kernel (kernels/small_linear.py) on the CPU under Triton's interpreter,
against the eager ops it replaces (the layers' RMSNorm and SiLU-and-mul, F.linear, a bf16 residual add),
for sizes that are not multiples of the blocks and every fusion. tests/test_gpu.py checks the whole
forward with it on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from spec_runtime.kernels import small_linear as triton_linear  # noqa: E402
from spec_runtime.kernels.plan import BlockTable  # noqa: E402
from spec_runtime.kernels.small_linear import MAX_ROWS, small_linear  # noqa: E402
from spec_runtime.layers.activation import silu_mul as _silu_mul  # noqa: E402
from spec_runtime.layers.norm import rms_norm as _rmsnorm  # noqa: E402


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


@pytest.mark.parametrize("kind", ["plain_add", "norm", "norm_silu_mul"])
def test_every_candidate_block_gives_the_same_result(kind: str) -> None:
    """kernels.tuning.tune_small_linear may pick any of the candidates on a GPU: each
    must compute the same thing, here with K past one block for the smaller BLOCK_Ks
    and N not a multiple of BLOCK_N."""
    n, k = 44, 1100
    x, w, g = _data(1, n, k, seed=4)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(torch.bfloat16)
    residual = (torch.randn(1, n, generator=g) * 4).to(torch.bfloat16)
    norm, silu = kind != "plain_add", kind == "norm_silu_mul"
    h = _rmsnorm(x, nw, 1e-5).float() if norm else x.float()
    want = F.linear(h, w.float())
    want = _silu_mul(want) if silu else want if norm else residual.float() + want
    blocks = triton_linear.candidates(k, norm=norm, silu_mul=silu)
    assert len(blocks) >= 4 and blocks[0] == triton_linear.block_sizes(n, k, norm=norm, silu_mul=silu)
    for block in blocks:
        add_to = residual.clone() if kind == "plain_add" else None
        got = small_linear(x, w, norm_weight=nw if norm else None, eps=1e-5, silu_mul=silu, add_to=add_to,
                           block=block)
        _close(got, want, tol=1e-2 if kind == "plain_add" else 2e-2)


def test_block_table_is_per_shape_per_table_and_resettable() -> None:
    shape = dict(norm=True, silu_mul=False)
    table, other_table = BlockTable(), BlockTable()
    default = triton_linear.block_sizes(96, 4096, **shape, table=table)
    assert default == triton_linear.candidates(4096, **shape)[0] == triton_linear.block_sizes(96, 4096, **shape)
    other = triton_linear.candidates(4096, **shape)[1]
    table.set(96, 4096, **shape, block=other)
    assert table.is_tuned(96, 4096, **shape)
    assert triton_linear.block_sizes(96, 4096, **shape, table=table) == other
    assert triton_linear.block_sizes(96, 4096, norm=False, silu_mul=False, table=table) != other  # another kind
    assert triton_linear.block_sizes(128, 4096, **shape, table=table) == default  # another shape
    assert triton_linear.block_sizes(96, 4096, **shape, table=other_table) == default  # another model's table
    table.set(96, 4096, **shape, block=None)
    assert not table.is_tuned(96, 4096, **shape)
    assert triton_linear.block_sizes(96, 4096, **shape, table=table) == default


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_layer_with_small_linear_matches_the_cublas_layer(model: str, request) -> None:
    """A decoder layer runs one token as forward_one_token (four one-token kernel calls)
    and larger batches as forward (projections, then the separate norms and SiLU-and-mul);
    kernels.tuning.pick_small_linear times both. On the same weights and the same
    attention they must agree: the one-token residual stream after the layer is
    forward's output plus its residual. qwen2 has a qkv bias. The plan stays eager
    (not fused) here: forward_one_token calls the kernel whatever the plan says."""
    from spec_runtime.config import ModelConfig
    from spec_runtime.engine.runner import ModelRunner

    runner = ModelRunner(ModelConfig(path=request.getfixturevalue(model), dtype="bfloat16"),
                         num_slots=1, max_model_len=32)
    m = runner.model
    arch = m.arch

    def attend(qkv: torch.Tensor) -> torch.Tensor:  # some fixed function of q, k and v
        return qkv[:, :arch.q_size] * 0.5 + qkv[:, arch.q_size:arch.q_size + arch.kv_size].repeat(
            1, arch.num_heads // arch.num_kv_heads)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, arch.hidden_size, generator=g).to(torch.bfloat16)
    assert not m.kernels.fused  # eager norms and SiLU-and-mul on a CPU
    with torch.inference_mode():
        residual, want = x.clone(), None
        for layer in m.layers:
            layer.forward_one_token(residual, attend)
            want = layer(x if want is None else want[0], None if want is None else want[1], attend)
    _close(residual, want[0].float() + want[1].float())
