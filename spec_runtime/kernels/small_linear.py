"""The one-token projection: a Triton linear layer for one row (a decode or draft step
of one sequence) with the small ops around it folded in.

A decoder layer's four projections at one token, with the norms, residual adds and
SiLU-and-mul inside them:

    qkv      = W_qkv · rmsnorm(h)         norm folded in (NORM)
    h       += W_o · attn                 residual add in the epilogue (ADD)
    act      = silu(W_g · n) * (W_u · n)  n = rmsnorm(h) (NORM, SILU_MUL)
    h       += W_down · act               (ADD)

The norm needs the whole row, and each program walks the whole K anyway, so it sums
x^2 as it goes and scales its outputs by rsqrt(mean + eps) at the end:
W · (x * g * r) = r * (W · (x * g)) for a per-row r. The residual stream `h` is
updated in place: each output element belongs to one program. Numerics: float32
accumulation, the residual rounded to its dtype once per add (the cuBLAS path rounds
the projection output first, then adds), and x * g rounded to the weight dtype before
the product.

One program per BLOCK_N output columns walks K in BLOCK_K steps, multiplying and adding
elementwise, and sums over K once at the end. Which block sizes pay depends on the
shape and the GPU: kernels/tuning.py times the `candidates` on a model's own weights
at start-up and records the fastest in the model's BlockTable (kernels/plan.py).
docs/kernels.md says when this kernel is chosen and what it is measured against.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from spec_runtime.kernels.plan import ONE_TOKEN_ROWS, Block, BlockTable

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Token counts this kernel serves; more go to cuBLAS (docs/kernels.md says why one).
MAX_ROWS = ONE_TOKEN_ROWS

# Block sizes to choose from per kind of projection, the default first; tuning picks
# among them on the model's own weights.
_CANDIDATES: dict[str, tuple[Block, ...]] = {
    # gate and up: two [BLOCK_N, BLOCK_K] float32 products live per step
    "silu_mul": ((2, 2048, 4), (8, 512, 4), (4, 1024, 4), (2, 1024, 4), (4, 512, 4), (8, 1024, 8),
                 (16, 512, 8), (4, 2048, 8)),
    "norm": ((4, 2048, 8), (4, 1024, 4), (8, 1024, 8), (8, 512, 4), (16, 512, 8), (8, 2048, 8),
             (16, 1024, 8), (4, 4096, 8)),
    # o and down, with or without the residual add
    "plain": ((8, 1024, 8), (16, 512, 8), (4, 1024, 4), (8, 512, 4), (4, 2048, 8), (16, 256, 4),
              (8, 2048, 8), (32, 256, 8), (4, 4096, 8)),
}


def _kind(norm: bool, silu_mul: bool) -> str:
    return "silu_mul" if silu_mul else "norm" if norm else "plain"


def _clamp(block: Block, k: int) -> Block:
    bn, bk, warps = block
    return bn, min(bk, triton.next_power_of_2(k)), warps


def _default(k: int, norm: bool, silu_mul: bool) -> Block:
    if silu_mul:
        block = (2, 2048, 4) if k >= 2048 else (8, 512, 4)
    elif norm:
        block = (4, 2048, 8) if k % 2048 == 0 and k > 2048 else (4, 1024, 4)
    else:
        block = (8, 1024, 8)
    return _clamp(block, k)


def candidates(k: int, *, norm: bool, silu_mul: bool) -> list[Block]:
    """The distinct block sizes to try for a projection with K inputs, the default first."""
    out = [_default(k, norm, silu_mul)]
    for block in _CANDIDATES[_kind(norm, silu_mul)]:
        block = _clamp(block, k)
        if block not in out:
            out.append(block)
    return out


def block_sizes(weight_rows: int, k: int, *, norm: bool, silu_mul: bool, table: BlockTable | None = None) -> Block:
    """(BLOCK_N, BLOCK_K, num_warps) for a [weight_rows, k] weight: the block `table`
    holds for it, else the default for its kind."""
    tuned = table.get(weight_rows, k, norm=norm, silu_mul=silu_mul) if table is not None else None
    return tuned or _default(k, norm, silu_mul)


@triton.jit
def _small_linear_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, norm_ptr,
    N, K, stride_wn, eps,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # x [K] times w [N, K]^T -> out [N]: one program per BLOCK_N outputs.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    # Elementwise products summed over the K steps, reduced across K once at the end.
    part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    part_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # SILU_MUL: the up half
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BK]
        if HAS_NORM:
            sumsq += x * x
            g = tl.load(norm_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = (x * g).to(w_ptr.dtype.element_ty).to(tl.float32)
        wmask = mask_n[:, None] & mask_k[None, :]
        # Each weight is read once per forward: evict_first keeps it from pushing x, the
        # norm weight and the residual out of L2.
        w = tl.load(w_rows + offs_k[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")  # [BN, BK]
        part += w.to(tl.float32) * x[None, :]
        if SILU_MUL:
            w_up = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=wmask, other=0.0,
                           eviction_policy="evict_first")
            part_up += w_up.to(tl.float32) * x[None, :]
    acc = tl.sum(part, axis=1)  # [BN]
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
        acc = acc * rstd
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.sum(part_up, axis=1)
        if HAS_NORM:
            up = up * rstd
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if ADD:
        acc += tl.load(out_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def small_linear(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                 add_to: torch.Tensor | None = None, block: Block | None = None,
                 table: BlockTable | None = None) -> torch.Tensor:
    """x [1, K] times weight [N, K]^T, with optional fusions:

    norm_weight: x is RMSNorm'ed (weight norm_weight, eps) first;
    bias: added to the product;
    silu_mul: weight is [2I, K] = [gate; up] and the result is silu(gate) * up, [1, I];
    add_to: [1, N] tensor the product is added to in place (and returned);
    block: (BLOCK_N, BLOCK_K, num_warps) for this call, else `block_sizes`' for `table`.
    Returns [1, N] (or [1, I]) in x's dtype.
    """
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"small_linear takes at most {MAX_ROWS} row, got {m}")
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not take {k} inputs")
    if silu_mul and (add_to is not None or bias is not None):
        raise ValueError("silu_mul does not combine with bias or add_to")
    x = x.contiguous()
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if add_to is not None:
        if tuple(add_to.shape) != (m, n) or not add_to.is_contiguous():
            raise ValueError(f"add_to must be a contiguous [{m}, {n}] tensor, got {tuple(add_to.shape)}")
        out = add_to
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (x, weight, out, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
            n, k, weight.stride(0), eps)
    flags = dict(HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
                 ADD=add_to is not None)
    if block is not None:
        bn, bk, warps = _clamp(block, k)
    elif _INTERPRET:  # small blocks, so the tests' sizes take several of them
        bn, bk, warps = 16, 64, 4
    else:
        bn, bk, warps = block_sizes(weight.shape[0], k, norm=norm_weight is not None, silu_mul=silu_mul,
                                    table=table)
    _small_linear_kernel[(triton.cdiv(n, bn),)](*args, **flags, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                num_stages=2)
    return out

