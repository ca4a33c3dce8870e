"""Triton kernels for the CUDA hot path: paged attention with no host planning, and
the fused RoPE + KV write.

Why not flashinfer everywhere: flashinfer's `plan()` runs on the host before every
forward (it reads the kv lengths to split the work) and reuses one pinned buffer per
wrapper, which keeps the host at most one step ahead; in scripts/bench_step.py a
flashinfer-planned graph step was 0.17-0.51 ms slower than one with these kernels
(8B, 1B and 0.6B shapes at batch 1, H100 and H200). Every
CUDA-graph shape of this runtime (decode, verify of K+1, SSD glue and tree steps) has
the same q_len for every request and a short q_len, so a kernel that reads kv_indptr
and kv_indices from the device and splits the kv range by a fixed number of splits
needs no plan at all: replaying a graph is copying its inputs and launching it.
Prefill (long, ragged queries) still goes to flashinfer.

`paged_attention`: the requests of a batch each bring `q_len` queries (token order
request-major, as ForwardBatch lays them out) and attend to kv rows
kv_indices[kv_indptr[r]:kv_indptr[r+1]] under forward_batch.py's bottom-right causal
rule (query i of a request with n rows sees rows [0, n - q_len + i]). One program
handles (request, kv head, split): the q_len x group queries that share a kv head
are one [BLOCK_M, D] tile, so a GQA group reads each K/V row once. Each split covers
an equal share of the request's rows (computed on the device from its length) and
writes a partial output and log-sum-exp; the last split of a (request, kv head) to
finish, counted by an atomic, merges them (one kernel per layer where there were two).

`rope_store_kv`: one kernel per layer for what was four: split the fused qkv output,
optional per-head q/k RMSNorm (Qwen3), rotate q and k, and write k and v to their
pool rows. Rows of q come back as a new [T, Hq, D] tensor.

Both run under TRITON_INTERPRET=1 on the CPU, which is how the tests check them
against the SDPA backend without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter multiplies bf16 tiles wrongly in tl.dot; under it the
# kernel upcasts to float32 first (tests only; on the GPU the dots run in bf16).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Queries per (request, kv head) tile this kernel accepts: q_len * group <= MAX_TILE_M.
MAX_TILE_M = 128


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, o_part_ptr, lse_part_ptr, count_ptr, out_ptr,
    stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_ot, stride_oh,
    scale,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr_ptr + req)
    kv_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
    # This split's share of [0, kv_len), in whole BLOCK_N blocks.
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    offs_m = tl.arange(0, BLOCK_M)  # tile row m: query i = m // GROUP, head kvh * GROUP + m % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    qi = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    m_valid = offs_m < Q_LEN * GROUP
    tok = req * Q_LEN + qi
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)  # [BLOCK_M, D]
    if DOT_F32:
        q = q.to(tl.float32)
    # Last kv position each row may see (bottom-right causal).
    last = kv_len - Q_LEN + qi  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        rows = tl.load(kv_indices_ptr + kv_start + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = tl.load(k_ptr + rows[:, None] * stride_kr + kvh * stride_kh + offs_d[None, :],
                    mask=n_valid[:, None], other=0.0)  # [BLOCK_N, D]
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] fp32
        allowed = n_valid[None, :] & (offs_n[None, :] <= last[:, None])
        s = tl.where(allowed, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rows[:, None] * stride_vr + kvh * stride_vh + offs_d[None, :],
                    mask=n_valid[:, None], other=0.0)  # [BLOCK_N, D]
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])
    else:
        # Partial result of this split; a split that saw no row of a query gets lse -inf.
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        rh = req * NUM_KV_HEADS + kvh
        part = (rh * NUM_SPLITS + split) * BLOCK_M + offs_m  # [R, Hkv, S, BLOCK_M] partial rows
        tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=m_valid[:, None])
        tl.store(lse_part_ptr + part, lse, mask=m_valid)
        # The last split of (request, kv head) to finish merges them all, so no second
        # kernel (and launch) is needed. The pattern of a grid-wide sync: every thread's
        # stores precede the CTA barrier; the counter's acq_rel atomic (one thread) then
        # publishes them at GPU scope and, in the last program, acquires the others'.
        # Its loads bypass L1 (.cg), which may hold lines of an earlier launch.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + rh, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            rows0 = rh * NUM_SPLITS * BLOCK_M + offs_m
            m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            for s in range(NUM_SPLITS):
                ls = tl.load(lse_part_ptr + rows0 + s * BLOCK_M, mask=m_valid, other=float("-inf"),
                             cache_modifier=".cg")
                m_all = tl.maximum(m_all, ls)
            m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # padding rows: no split saw a row
            o = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(NUM_SPLITS):
                ls = tl.load(lse_part_ptr + rows0 + s * BLOCK_M, mask=m_valid, other=float("-inf"),
                             cache_modifier=".cg")
                w = tl.exp(ls - m_all)  # a split with no rows of a query weighs 0
                o_s = tl.load(o_part_ptr + (rows0 + s * BLOCK_M)[:, None] * HEAD_DIM + offs_d[None, :],
                             mask=m_valid[:, None], other=0.0, cache_modifier=".cg")
                o += w[:, None] * o_s
                w_sum += w
            o = o / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])
            tl.atomic_xchg(count_ptr + rh, 0)  # zero again for the next launch (kernels run in order)


def num_splits_for(num_requests: int, num_kv_heads: int, num_sms: int, max_kv_len: int | None = None,
                   block_n: int = 32) -> int:
    """Splits per (request, kv head): enough programs to fill the GPU about twice,
    never so many that a split of `max_kv_len` rows is under one block."""
    s = max(1, min(32, triton.cdiv(2 * num_sms, num_requests * num_kv_heads)))
    if max_kv_len is not None:
        s = max(1, min(s, triton.cdiv(max_kv_len, block_n)))
    return s


# Per device: int32 counters, one per (request, kv head), of splits done; zero between launches.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed counters that persist across launches (and CUDA-graph replays). Made
    on the first eager call (a warm-up forward precedes every capture); a capture
    cannot allocate them."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("paged_attention: run it once outside CUDA-graph capture first "
                               f"(its {n} split counters are made then)")
        counters = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, *, q_len: int, num_splits: int, scale: float,
                    block_n: int = 32) -> torch.Tensor:
    """q [R * q_len, Hq, D]; k/v_cache [rows, Hkv, D]; kv_indptr [R+1], kv_indices [nnz]
    int32 on the device. Returns [R * q_len, Hq, D] in q's dtype. No host sync."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if t % q_len:
        raise ValueError(f"{t} query tokens are not a multiple of q_len {q_len}")
    r = t // q_len
    group = hq // hkv
    tile_m = q_len * group
    if tile_m > MAX_TILE_M:
        raise ValueError(f"q_len {q_len} x group {group} exceeds the {MAX_TILE_M}-row tile")
    block_m = max(16, triton.next_power_of_2(tile_m))
    q = q.contiguous()
    out = torch.empty_like(q)
    o_part = lse_part = count = out  # unused with one split
    if num_splits > 1:
        o_part = torch.empty(r * hkv * num_splits * block_m * d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(r * hkv * num_splits * block_m, dtype=torch.float32, device=q.device)
        count = _split_counters(q.device, r * hkv)
    _attn_split_kernel[(r, hkv, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, o_part, lse_part, count, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), scale,
        Q_LEN=q_len, GROUP=group, NUM_KV_HEADS=hkv, NUM_SPLITS=num_splits, HEAD_DIM=d,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=_INTERPRET,
    )
    return out


@triton.jit
def _rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, q_norm_ptr, k_norm_ptr,
    stride_qkv, stride_cos, stride_qo_t, stride_qo_h, stride_kr, stride_kh, stride_vr, stride_vh,
    eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
):
    # Program (token, head): heads [0, Hq) are q heads, [Hq, Hq + Hkv) kv heads (k and v).
    t = tl.program_id(0)
    h = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)
    is_q = h < NUM_HEADS
    col = h * HEAD_DIM  # q heads then k heads: consecutive in qkv
    x1 = tl.load(qkv_ptr + t * stride_qkv + col + offs).to(tl.float32)
    x2 = tl.load(qkv_ptr + t * stride_qkv + col + half + offs).to(tl.float32)
    if HAS_NORM:
        # Per-head RMSNorm in float32, rounded to the model dtype before the weight, as
        # cuda_ops._rmsnorm does.
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        if is_q:
            w1 = tl.load(q_norm_ptr + offs).to(tl.float32)
            w2 = tl.load(q_norm_ptr + half + offs).to(tl.float32)
        else:
            w1 = tl.load(k_norm_ptr + offs).to(tl.float32)
            w2 = tl.load(k_norm_ptr + half + offs).to(tl.float32)
        x1 = w1 * (x1 * inv).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        x2 = w2 * (x2 * inv).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        x1 = x1.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        x2 = x2.to(qkv_ptr.dtype.element_ty).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_cos + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_cos + half + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_cos + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_cos + half + offs).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    if is_q:
        dst = q_out_ptr + t * stride_qo_t + h * stride_qo_h
        tl.store(dst + offs, y1.to(q_out_ptr.dtype.element_ty))
        tl.store(dst + half + offs, y2.to(q_out_ptr.dtype.element_ty))
    else:
        kvh = h - NUM_HEADS
        row = tl.load(rows_ptr + t).to(tl.int64)
        kdst = k_cache_ptr + row * stride_kr + kvh * stride_kh
        tl.store(kdst + offs, y1.to(k_cache_ptr.dtype.element_ty))
        tl.store(kdst + half + offs, y2.to(k_cache_ptr.dtype.element_ty))
        vcol = (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM
        v1 = tl.load(qkv_ptr + t * stride_qkv + vcol + offs)
        v2 = tl.load(qkv_ptr + t * stride_qkv + vcol + half + offs)
        vdst = v_cache_ptr + row * stride_vr + kvh * stride_vh
        tl.store(vdst + offs, v1)
        tl.store(vdst + half + offs, v2)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, rows: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm_w: torch.Tensor | None = None, k_norm_w: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D], cos/sin [T, 1, D] or [T, D]; writes rotated k and v at
    pool rows `rows` [T]; returns rotated q [T, Hq, D]."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos = cos.reshape(t, head_dim)
    sin = sin.reshape(t, head_dim)
    q_out = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm_w is not None
    _rope_store_kernel[(t, num_heads + num_kv_heads)](
        qkv, cos, sin, q_out, k_cache, v_cache, rows,
        q_norm_w if has_norm else qkv, k_norm_w if has_norm else qkv,
        qkv.stride(0), cos.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm,
    )
    return q_out
