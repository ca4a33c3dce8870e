"""The Triton kernels of the CUDA path, run on the CPU by Triton's interpreter.

paged_attention is checked against the SDPA backend (the CPU reference) over ragged
kv lengths, GQA groups, q_len 1 to 9 and several split counts, with the same page
table a ForwardBatch carries; rope_store_kv against the layers' eager ops (RMSNorm,
RoPE) plus a plain KV write. On the GPU the same kernels run with bf16 tensor-core dots
(tests/test_gpu.py compares the whole forward there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from spec_runtime.attention.sdpa import SDPABackend, write_kv  # noqa: E402
from spec_runtime.engine.forward_batch import ForwardItem, build_forward_batch  # noqa: E402
from spec_runtime.engine.kv_cache import KVCache  # noqa: E402
from spec_runtime.kernels.paged import (  # noqa: E402
    kv_block,
    num_splits_for,
    paged_attention,
    rope_store_kv,
)
from spec_runtime.layers.norm import rms_norm  # noqa: E402
from spec_runtime.layers.rotary import apply_rope, rope_cos_sin  # noqa: E402

ROWS = 512


def _qk_rope(qkv, cos, sin, hq, hkv, d, q_norm_w, k_norm_w, eps):
    """The eager path of models/llama.py's Attention.attend up to the KV write."""
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()


def _pool(hkv: int, d: int, seed: int = 0) -> KVCache:
    torch.manual_seed(seed)
    kv = KVCache(1, ROWS, hkv, d, torch.bfloat16, "cpu")
    kv.k_cache[0].normal_()
    kv.v_cache[0].normal_()
    return kv


def _batch(q_len: int, kv_lens: list[int], seed: int):
    rng = np.random.default_rng(seed)
    items = [ForwardItem([0] * q_len, n - q_len, rng.choice(ROWS, n, replace=False), "all") for n in kv_lens]
    return build_forward_batch(items, "cpu")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 32), (8, 2, 64), (16, 2, 16)])
@pytest.mark.parametrize("q_len,kv_lens,splits", [
    (1, [1, 5, 70, 33], 4),  # decode; a one-row request; more splits than some have blocks
    (4, [4, 50, 100], 3),  # verify-like: bottom-right causal inside the block
    (9, [9, 40], 1),  # K+1 = 9 with no split: one program sees everything
    (2, [130, 2, 64], 8),  # splits that end up empty for short requests
])
def test_paged_attention_matches_sdpa(hq, hkv, d, q_len, kv_lens, splits):
    kv = _pool(hkv, d)
    batch = _batch(q_len, kv_lens, seed=q_len * 7 + hq)
    q = torch.randn(len(kv_lens) * q_len, hq, d).bfloat16()
    ref_backend = SDPABackend(hq, hkv, d)
    ref_backend.begin(batch)
    # The pool already holds the new tokens' rows: hand SDPA the same values to write.
    k_new = kv.k_cache[0][batch.kv_write_rows].clone()
    v_new = kv.v_cache[0][batch.kv_write_rows].clone()
    ref = ref_backend.forward(0, q, k_new, v_new, kv, batch)
    out = paged_attention(q, kv.k_cache[0], kv.v_cache[0], batch.kv_indptr, batch.kv_indices,
                          q_len=q_len, num_splits=splits, scale=d**-0.5)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert _rel_err(out, ref) < 1e-2


def test_paged_attention_rejects_ragged_and_oversized_tiles():
    kv = _pool(1, 16)
    batch = _batch(1, [3, 4], seed=0)
    q = torch.randn(3, 2, 16).bfloat16()
    with pytest.raises(ValueError, match="multiple of q_len"):
        paged_attention(q, kv.k_cache[0], kv.v_cache[0], batch.kv_indptr, batch.kv_indices,
                        q_len=2, num_splits=1, scale=0.25)
    q = torch.randn(2 * 16, 16, 16).bfloat16()  # q_len 16 x group 16 = 256 rows
    with pytest.raises(ValueError, match="tile"):
        paged_attention(q, kv.k_cache[0], kv.v_cache[0], batch.kv_indptr, batch.kv_indices,
                        q_len=16, num_splits=1, scale=0.25)


def test_num_splits_fills_one_wave_but_not_past_the_rows():
    assert num_splits_for(1, 8, 132) == 32  # capped at 32
    assert num_splits_for(16, 8, 132) == 4  # 4 programs per SM: 528 // 128
    assert num_splits_for(16, 8, 132, tile_rows=72) == 2  # a 128-row tile: 2 per SM, 264 // 128
    assert num_splits_for(4, 8, 132, tile_rows=36) == 8  # not 9: 288 programs would need a second wave
    assert num_splits_for(64, 8, 132) == 1
    assert num_splits_for(1, 8, 132, max_kv_len=40) == 2  # 40 rows: two blocks of 32


def test_heads_of_64_dims_take_64_row_blocks():
    assert kv_block(64) == 64 and kv_block(32) == 64 and kv_block(128) == 32
    assert kv_block(64, tile_rows=64) == 64 and kv_block(64, tile_rows=96) == 32  # 128-row tiles: unmeasured
    assert num_splits_for(16, 8, 132, tile_rows=96, head_dim=64) == 2  # ... and the 32-row rule's count
    assert num_splits_for(16, 8, 132, tile_rows=20, head_dim=64) == 4  # tiles of up to 24 rows: 4 per SM
    assert num_splits_for(16, 8, 132, tile_rows=32, head_dim=64) == 3  # larger ones 3 per SM, 396 // 128
    assert num_splits_for(32, 8, 132, tile_rows=32, head_dim=64) == 3  # ... and at least 3 splits (396 // 256 = 1)
    assert num_splits_for(16, 8, 132, tile_rows=32, head_dim=128) == 4
    assert num_splits_for(16, 8, 132, tile_rows=64, head_dim=128) == 2
    assert num_splits_for(1, 8, 132, max_kv_len=100, head_dim=64) == 2  # 100 rows: two blocks of 64


# The interpreter truncates float32 -> bf16 (the GPU rounds to nearest), so in bf16
# the kernel is ~1 ulp low at each of its casts; float32 checks the math tightly.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv_matches_eager_ops(qk_norm, dtype, tol):
    hq, hkv, d, t = 6, 2, 32, 5
    torch.manual_seed(1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    positions = torch.tensor([0, 3, 17, 100, 4000])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    qn = (torch.rand(d) + 0.5).to(dtype) if qk_norm else None
    kn = (torch.rand(d) + 0.5).to(dtype) if qk_norm else None
    rows = torch.tensor([7, 1, 30, 12, 2])

    # Reference in float32 (the eager bf16 ops round after every op, the kernel once).
    ref_kv = KVCache(1, 40, hkv, d, torch.float32, "cpu")
    q_ref, k_ref, v_ref = _qk_rope(qkv.float(), cos.float(), sin.float(), hq, hkv, d,
                                   qn.float() if qk_norm else None, kn.float() if qk_norm else None, 1e-6)
    write_kv(ref_kv, 0, k_ref, v_ref, rows)

    kv = KVCache(1, 40, hkv, d, dtype, "cpu")
    q = rope_store_kv(qkv, cos, sin, kv.k_cache[0], kv.v_cache[0], rows, num_heads=hq, num_kv_heads=hkv,
                      head_dim=d, q_norm_w=qn, k_norm_w=kn, eps=1e-6)
    assert q.shape == (t, hq, d)
    assert _rel_err(q, q_ref) < tol
    assert _rel_err(kv.k_cache[0], ref_kv.k_cache[0]) < tol
    assert torch.equal(kv.v_cache[0].float(), ref_kv.v_cache[0])  # v is copied bit for bit
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows] = False
    assert not kv.k_cache[0][untouched].any()  # nothing else written


def _tree_batch(seed: int, q_len: int, prefix_lens: list[int], branches_per_req: list[int]):
    """A tree step over random pool rows: each request a prefix, each branch 1..6 own rows."""
    from spec_runtime.engine.forward_batch import TreeBranch, build_tree_batch

    rng = np.random.default_rng(seed)
    rows = rng.permutation(ROWS - 1)  # the last row is the dummy row
    used = 0
    prefixes, branches = [], []
    for n, nb in zip(prefix_lens, branches_per_req):
        prefixes.append(rows[used : used + n])
        used += n
        brs = []
        for _ in range(nb):
            m = int(rng.integers(1, 7))
            brs.append(TreeBranch(0, n, rows[used : used + m], int(rng.integers(1, m + 1))))
            used += m
        branches.append(brs)
    return build_tree_batch(prefixes, branches, q_len, ROWS - 1, "cpu")


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 32), (8, 2, 64)])
@pytest.mark.parametrize("q_len,prefix_lens,branches,splits", [
    (4, [70, 3], [4, 2], 3),  # a padded request; a prefix shorter than one block
    (8, [130], [5], 8),  # splits over the prefix, the branches' rows at the tail
    (2, [1, 40, 64], [2, 1, 2], 1),
])
@pytest.mark.parametrize("block_n", [None, 32])  # kv_block's (64 for these heads), and 32 as for 128-dim heads
def test_paged_attention_tree_mask_matches_sdpa(hq, hkv, d, q_len, prefix_lens, branches, splits, block_n):
    from spec_runtime.engine.forward_batch import tree_step_batch

    kv = _pool(hkv, d, seed=3)
    first = _tree_batch(q_len * 5 + hq, q_len, prefix_lens, branches)
    # Step 0 and a later step (one more row visible per real branch).
    for batch in (first, tree_step_batch(first, 1, first.input_ids)):
        q = torch.randn(batch.input_ids.shape[0], hq, d).bfloat16()
        ref_backend = SDPABackend(hq, hkv, d)
        ref_backend.begin(batch)
        k_new = kv.k_cache[0][batch.kv_write_rows].clone()
        v_new = kv.v_cache[0][batch.kv_write_rows].clone()
        ref = ref_backend.forward(0, q, k_new, v_new, kv, batch)
        tr = batch.tree
        out = paged_attention(q, kv.k_cache[0], kv.v_cache[0], batch.kv_indptr, batch.kv_indices, q_len=q_len,
                              num_splits=splits, scale=d**-0.5, tree=(tr.prefix_len, tr.lo, tr.hi), block_n=block_n)
        assert _rel_err(out, ref) < 1e-2
        # The mask matters: the causal rule over the same rows gives another answer.
        causal = paged_attention(q, kv.k_cache[0], kv.v_cache[0], batch.kv_indptr, batch.kv_indices,
                                 q_len=q_len, num_splits=splits, scale=d**-0.5)
        assert _rel_err(causal, ref) > 5e-2


def test_dense_race_and_uniforms_match_the_torch_sampling_ops():
    """The target's race over the vocabulary and the accept test's uniforms (kernels/race.py)
    against sampling's torch ops: the same uniforms bit for bit, the same winners (the
    interpreter's float64 log is NumPy's, the GPU test compares on the device's)."""
    from spec_runtime.kernels.race import dense_race, uniforms
    from spec_runtime.sampling import STREAM_ACCEPT, STREAM_TARGET, sample_torch, stream_key, uniform_torch

    g = torch.Generator().manual_seed(0)
    b, vocab = 6, 5000
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g)
    positions = torch.randint(0, 2**31, (b,), generator=g)
    probs = torch.softmax(3 * torch.randn(b, vocab, generator=g), -1)
    probs[0, 100:] = 0.0
    probs[1] = 1.0
    got = dense_race(probs, seeds, positions, stream_key(STREAM_TARGET), chunk=1024)  # five chunks, the last partial
    assert torch.equal(got, sample_torch(probs, seeds, positions, STREAM_TARGET))
    assert int(got[0]) < 100
    k = 5
    seeds_k, positions_k = seeds.unsqueeze(-1).expand(b, k), positions.unsqueeze(-1) + torch.arange(k)
    zero = torch.zeros(1, dtype=torch.int64)
    assert torch.equal(uniforms(seeds_k, positions_k, stream_key(STREAM_ACCEPT), zero),
                       uniform_torch(seeds_k, positions_k, STREAM_ACCEPT, zero))
    index = torch.randint(0, vocab, (b, 7), generator=g)
    assert torch.equal(uniforms(seeds, positions, stream_key(STREAM_TARGET), index),
                       uniform_torch(seeds, positions, STREAM_TARGET, index))


class _PagedPrefill:
    """flashinfer's BatchPrefillWithPagedKVCacheWrapper as documented, for page size 1 and
    causal=False: each request's queries over its kv rows, with the log-sum-exp."""

    def __init__(self, *args, **kwargs):
        pass

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size, causal, sm_scale,
             **kwargs):
        assert page_size == 1 and not causal and bool((last_page_len == 1).all())
        self.qo, self.kv_indptr, self.kv_indices = qo_indptr, kv_indptr, kv_indices
        self.group, self.scale = hq // hkv, sm_scale

    def run(self, q, paged, return_lse=False):
        k, v = paged[0][:, 0].float(), paged[1][:, 0].float()  # NHD pages of one row
        out, lse = torch.zeros(q.shape), torch.zeros(q.shape[:2])
        for r in range(len(self.qo) - 1):
            rows = self.kv_indices[self.kv_indptr[r]:self.kv_indptr[r + 1]].long()
            qs = slice(int(self.qo[r]), int(self.qo[r + 1]))
            s = torch.einsum("thd,nhd->htn", q[qs].float(), k[rows].repeat_interleave(self.group, 1)) * self.scale
            out[qs] = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v[rows].repeat_interleave(self.group, 1))
            lse[qs] = torch.logsumexp(s, -1).T
        return out.to(q.dtype), lse


def _merge_state_in_place(v, s, v_other, s_other):
    merged = torch.logaddexp(s, s_other)
    v.copy_(v.float() * torch.exp(s - merged)[..., None] + v_other.float() * torch.exp(s_other - merged)[..., None])
    s.copy_(merged)


@pytest.mark.parametrize("hq,hkv,d,bs,q_len,ctx", [(4, 2, 16, 2, 4, 20), (8, 2, 32, 3, 8, 70)])
def test_bench_attention_cascade_reads_the_rows_of_the_tree_mask(monkeypatch, hq, hkv, d, bs, q_len, ctx):
    """scripts/bench_attention.py --cascade: its two levels (each request's prefix for all its
    branches, each branch's own rows) give the Triton kernel's tree step, flashinfer stood in
    for by the documented computation; with each branch's rows one further on they do not."""
    import importlib.util
    import sys
    import types
    from pathlib import Path

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_PagedPrefill, merge_state_in_place=_merge_state_in_place))
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = torch.Generator().manual_seed(hq + ctx)
    per_req = ctx + q_len * bench.TREE_WIDTH
    k = torch.randn(1, bs * per_req, hkv, d, generator=g).bfloat16()
    v = torch.randn(1, bs * per_req, hkv, d, generator=g).bfloat16()
    kv = (k, v, torch.arange(0, bs * per_req + 1, per_req, dtype=torch.int32),
          torch.arange(bs * per_req, dtype=torch.int32), per_req)
    q = torch.randn(bs * q_len, hq, d, generator=g).bfloat16()
    cascade = bench._cascade(torch, (hq, hkv, d), bs, q_len, ctx, kv, q)(0)
    prefix_len, lo, hi = bench._tree_mask(torch, bs, q_len, ctx, "cpu")
    for shift, close in ((0, True), (1, False)):
        triton_out = paged_attention(q, k[0], v[0], kv[2], kv[3], q_len=q_len, num_splits=2, scale=d**-0.5,
                                     tree=(prefix_len, lo + shift, hi + shift))
        assert (_rel_err(cascade, triton_out) < 1e-2) == close
