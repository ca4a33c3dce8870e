"""Triton kernels for the CUDA hot path: paged attention with no host planning, and
the fused RoPE + KV write.

Every CUDA-graph shape of this runtime (decode, verify of K+1, SSD glue and tree
steps) has the same short q_len for every request, so a kernel that reads kv_indptr and
kv_indices from the device and splits the kv range by a fixed number of splits needs no
host plan at all: replaying a graph is copying its inputs and launching it. Prefill
(long, ragged queries) goes to flashinfer. docs/kernels.md compares the two.

`paged_attention`: the requests of a batch each bring `q_len` queries (token order
request-major, as ForwardBatch lays them out) and attend to kv rows
kv_indices[kv_indptr[r]:kv_indptr[r+1]] under forward_batch.py's bottom-right causal
rule (query i of a request with n rows sees rows [0, n - q_len + i]). One program
handles (request, kv head, split): the q_len x group queries that share a kv head
are one [BLOCK_M, D] tile, so a GQA group reads each K/V row once. Each split covers
an equal share of the request's rows (computed on the device from its length) and
writes a partial output and log-sum-exp; a second kernel merges the splits.

`rope_store_kv`: one kernel per layer for four steps: split the fused qkv output,
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
def _load_tile(ptr, rows, stride_r, col, offs_d, valid, DOT_F32: tl.constexpr):
    """Rows [len(rows), HEAD_DIM] of a [rows, heads, D] tensor at head offset `col`;
    masked rows read 0 (float32 under DOT_F32)."""
    x = tl.load(ptr + rows[:, None] * stride_r + col + offs_d[None, :], mask=valid[:, None], other=0.0)
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _softmax_update(s, allowed, m_i, l_i):
    """One BLOCK_N block of online softmax over scores s [BLOCK_M, BLOCK_N] (float32),
    masked to `allowed`: the new running max, the rescale of what came before, the
    block's weights p and the new running sum."""
    s = tl.where(allowed, s, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _store_split(o_part_ptr, lse_part_ptr, base, offs_m, offs_d, m_valid, m_i, l_i, acc,
                 BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A split's partial output and log-sum-exp at partial index `base`; a split that saw
    no row of a query gets lse -inf."""
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(o_part_ptr + (base * BLOCK_M + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=m_valid[:, None])
    tl.store(lse_part_ptr + base * BLOCK_M + offs_m, lse, mask=m_valid)


# Q_LEN and NUM_SPLITS are plain arguments, not compile-time constants: eager forwards of
# every q_len up to MAX_TILE_M / GROUP, at split counts that follow the context length, run
# one compiled kernel per tile shape (BLOCK_M) instead of compiling on first use of each pair.
@triton.jit(do_not_specialize=["Q_LEN", "NUM_SPLITS"])
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, o_part_ptr, lse_part_ptr,
    prefix_len_ptr, lo_ptr, hi_ptr,
    stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
    scale, Q_LEN, NUM_SPLITS,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    TREE: tl.constexpr,
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
    m_valid = offs_m < Q_LEN * GROUP
    tok = req * Q_LEN + qi
    head = kvh * GROUP + offs_m % GROUP
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)  # [BLOCK_M, D]
    if DOT_F32:
        q = q.to(tl.float32)
    last = kv_len - Q_LEN + qi  # last kv position each row may see (bottom-right causal)
    if TREE:
        # Shared-prefix mask: rows [0, prefix_len) for every query, then [lo, hi) of its own.
        prefix_len = tl.load(prefix_len_ptr + req)
        lo_t = tl.load(lo_ptr + tok, mask=m_valid, other=0)  # [BLOCK_M]
        hi_t = tl.load(hi_ptr + tok, mask=m_valid, other=0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        rows = tl.load(kv_indices_ptr + kv_start + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = _load_tile(k_ptr, rows, stride_kr, kvh * stride_kh, offs_d, n_valid, DOT_F32)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] fp32
        if TREE:
            own = (offs_n[None, :] >= lo_t[:, None]) & (offs_n[None, :] < hi_t[:, None])
            allowed = n_valid[None, :] & ((offs_n[None, :] < prefix_len) | own)
        else:
            allowed = n_valid[None, :] & (offs_n[None, :] <= last[:, None])
        m_i, alpha, p, l_i = _softmax_update(s, allowed, m_i, l_i)
        v = _load_tile(v_ptr, rows, stride_vr, kvh * stride_vh, offs_d, n_valid, DOT_F32)  # [BLOCK_N, D]
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    base = (req * NUM_KV_HEADS + kvh) * NUM_SPLITS + split  # [R, Hkv, S] partial index
    _store_split(o_part_ptr, lse_part_ptr, base, offs_m, offs_d, m_valid, m_i, l_i, acc, BLOCK_M, HEAD_DIM)


@triton.jit(do_not_specialize=["Q_LEN", "NUM_SPLITS"])
def _attn_merge_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, stride_ot, stride_oh, Q_LEN, NUM_SPLITS,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program per (request, kv head, tile row): every output row merges in parallel.
    rh = tl.program_id(0)
    m = tl.program_id(1)
    req = rh // NUM_KV_HEADS
    kvh = rh % NUM_KV_HEADS
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM)
    part_rows = (rh * NUM_SPLITS + offs_s) * BLOCK_M + m  # [BLOCK_S]
    lse = tl.load(lse_part_ptr + part_rows, mask=s_valid, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # splits with no rows weigh 0
    w = w / tl.sum(w, axis=0)
    part = tl.load(o_part_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_valid[:, None], other=0.0)  # [BLOCK_S, D]
    o = tl.sum(part * w[:, None], axis=0)
    tok = req * Q_LEN + m // GROUP
    head = kvh * GROUP + m % GROUP
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def kv_block(head_dim: int, tile_rows: int = 16) -> int:
    """K/V rows per step of the split kernel's loop: 64 for heads of up to 64 dims in
    tiles of up to 64 query rows (a block of 32 such rows leaves the loop bound by its
    loads' latency), else 32; 128-row tiles keep 32, unmeasured with 64
    (docs/kernels.md, "KV block")."""
    return 64 if head_dim <= 64 and tile_rows <= 64 else 32


def num_splits_for(num_requests: int, num_kv_heads: int, num_sms: int, max_kv_len: int | None = None,
                   tile_rows: int = 16, head_dim: int = 128) -> int:
    """Splits per (request, kv head): as many programs as run on the GPU at once, never
    more, and never so many that a split of `max_kv_len` rows is under one block.

    tile_rows: the queries of one program (q_len x GQA group). With 32-row kv blocks, tiles
    of up to 32 rows run about four programs per SM, larger ones two. With the 64-row
    blocks of heads of up to 64 dims (kv_block), tiles of up to 24 rows four, larger ones
    three, and those at least three splits: their loop, bound by its loads' latency, was
    fastest over a third of a request's rows at batch 16 and 32 alike. A grid just past
    the count runs a second wave as long as the first on a few SMs, so the count rounds
    down (docs/kernels.md, "Split count")."""
    block_n = kv_block(head_dim, tile_rows)
    wide = block_n == 64 and tile_rows > 24
    per_sm = (3 if wide else 4) if block_n == 64 else (4 if tile_rows <= 32 else 2)
    s = max(1, min(32, per_sm * num_sms // (num_requests * num_kv_heads)))
    if wide:
        s = max(s, 3)
    if max_kv_len is not None:
        s = max(1, min(s, triton.cdiv(max_kv_len, block_n)))
    return s


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, *, q_len: int, num_splits: int, scale: float,
                    block_n: int | None = None, tree=None, num_warps: int = 4,
                    num_stages: int | None = None) -> torch.Tensor:
    """q [R * q_len, Hq, D]; k/v_cache [rows, Hkv, D]; kv_indptr [R+1], kv_indices [nnz]
    int32 on the device. Returns [R * q_len, Hq, D] in q's dtype. No host sync.

    tree: (prefix_len [R], lo [T], hi [T]) int32 for a tree step's shared-prefix mask
    (forward_batch.TreeMask), in place of the causal rule. A request's q_len branches
    share one tile, so each split reads its share of the prefix once for all of them.
    block_n, num_warps, num_stages: the split kernel's kv block (None: kv_block's) and
    launch (None: Triton's default stages)."""
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
    block_n = block_n or kv_block(d, tile_m)
    q = q.contiguous()
    o_part = torch.empty(r * hkv * num_splits * block_m * d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(r * hkv * num_splits * block_m, dtype=torch.float32, device=q.device)
    prefix_len, lo, hi = tree if tree is not None else (kv_indptr, kv_indptr, kv_indptr)  # unused without TREE
    _attn_split_kernel[(r, hkv, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, o_part, lse_part, prefix_len, lo, hi,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        scale, q_len, num_splits,
        GROUP=group, NUM_KV_HEADS=hkv, HEAD_DIM=d,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=_INTERPRET, TREE=tree is not None,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    out = torch.empty_like(q)
    _attn_merge_kernel[(r * hkv, tile_m)](
        o_part, lse_part, out, out.stride(0), out.stride(1), q_len, num_splits,
        GROUP=group, NUM_KV_HEADS=hkv, HEAD_DIM=d,
        BLOCK_M=block_m, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out


def tile_variants(num_heads: int, num_kv_heads: int, max_q_len: int) -> dict[int, int]:
    """The split kernel's tile sizes (BLOCK_M) that forwards of up to `max_q_len` queries per
    request meet, each with the least q_len that meets it."""
    group = num_heads // num_kv_heads
    tiles: dict[int, int] = {}
    for q_len in range(1, min(max_q_len, MAX_TILE_M // group) + 1):
        tiles.setdefault(max(16, triton.next_power_of_2(q_len * group)), q_len)
    return tiles


def warm_up(device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *,
            max_q_len: int, tree_q_len: int = 0) -> int:
    """Compile (or load from Triton's cache) every variant of the split and merge kernels
    that forwards of up to `max_q_len` queries per request (tree steps: up to `tree_q_len`
    branches) can meet, the merge at every split count up to 32, now rather than in the
    step that first needs one: an eager forward's split count follows its batch and
    context, so a serving loop would meet new merge variants long after start-up, each a
    compile of tens to hundreds of milliseconds on a fresh host. Returns the launches made."""
    rows = MAX_TILE_M + 64  # more than any tile's queries: every query sees rows
    kv = torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device)
    indptr = torch.tensor([0, rows], dtype=torch.int32, device=device)
    indices = torch.arange(rows, dtype=torch.int32, device=device)
    launches = 0
    for limit, trees in ((max_q_len, False), (tree_q_len, True)):
        for q_len in tile_variants(num_heads, num_kv_heads, limit).values():
            q = torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=device)
            lo = torch.arange(rows - q_len, rows, dtype=torch.int32, device=device)
            tree = (torch.tensor([rows - q_len], dtype=torch.int32, device=device), lo, lo + 1) if trees else None
            for splits in (1, 3, 5, 9, 17):  # merge tiles (BLOCK_S) of 2, 4, 8, 16 and 32 splits
                paged_attention(q, kv, kv, indptr, indices, q_len=q_len, num_splits=splits, scale=1.0, tree=tree)
                launches += 1
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return launches


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
        # layers/norm.py's rms_norm does.
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
