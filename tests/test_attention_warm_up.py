"""The start-up warm-up of the Triton paged attention (kernels/paged.py: warm_up) launches
every variant serving meets: for batches of 1 to 32 requests, 1 to 16 queries each (tree
steps: up to the widest tile), contexts of 17 to 8192 rows and the split counts
num_splits_for gives them, with the metadata uploaded as ForwardBatch uploads it
(staging.upload_int64), each launch of the split and merge kernels has the constexprs and
argument specialization (a pointer aligned to 16 bytes or not, an integer divisible by 16
or equal to 1) of one of the warm-up's launches. Run in a fresh interpreter: the other
kernel tests load Triton's interpreter, which has no specialization."""

from __future__ import annotations

import importlib.util

import pytest
from fresh_python import run_json

# Not imported here: Triton reads TRITON_INTERPRET once, at its import, and the kernel tests
# that run under its interpreter set it when they are collected, after this file.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

KEYS = r"""
import json
import numpy as np
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from spec_runtime.attention.cuda import MAX_TRITON_Q_LEN
from spec_runtime.engine.staging import upload_int64
from spec_runtime.kernels import paged

launches = []

class Recorder:
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel
    def __getitem__(self, grid):
        return lambda *args, **meta: launches.append((self.name, self.kernel, args, meta))

for name in ("_attn_split_kernel", "_attn_merge_kernel"):
    setattr(paged, name, Recorder(name, getattr(paged, name)))

def keys():
    out = set()
    for name, kernel, args, meta in launches:
        params = [p for p in kernel.params if not p.is_constexpr]
        spec = [native_specialize_impl(BaseBackend, a, p.is_const, not p.do_not_specialize,
                                       not p.do_not_specialize_on_alignment)[:2] for a, p in zip(args, params)]
        out.add(json.dumps([name, [list(s) for s in spec], sorted(meta.items())]))
    launches.clear()
    return out

result = {}
for hq, hkv, d in ((32, 8, 64), (32, 8, 128), (9, 3, 64), (64, 8, 128)):
    group = hq // hkv
    pool = torch.zeros(3, 9000, hkv, d, dtype=torch.bfloat16)  # [layers, rows, Hkv, D], one layer's view
    k_cache, v_cache = pool[1], pool[2]
    serving = set()
    for trees in (False, True):
        top = paged.MAX_TILE_M // group if trees else MAX_TRITON_Q_LEN
        for r in (1, 2, 3, 16, 32):
            for q_len in sorted({1, 2, 3, 5, 8, 13, 16, top} & set(range(1, top + 1))):
                for ctx in (17, 700, 8192):
                    t = r * q_len
                    kv_lens = np.full(r, ctx + q_len)
                    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
                    host = [np.arange(t), np.arange(t), np.arange(t), np.arange(r), np.arange(r + 1), kv_indptr,
                            np.arange(kv_indptr[-1])]
                    if trees:
                        lo = np.arange(t) % q_len + ctx
                        host += [lo, lo + 1, np.full(r, ctx)]
                    up = upload_int64(host, "cpu", int32_tail=len(host) - 4, packed=3)
                    tree = tuple(up[7:10]) if trees else None
                    q = torch.zeros(t, hq, d, dtype=torch.bfloat16)
                    splits = paged.num_splits_for(r, hkv, 132, ctx + q_len, tile_rows=q_len * group, head_dim=d)
                    paged.paged_attention(q, k_cache, v_cache, up[5], up[6], q_len=q_len, num_splits=splits,
                                          scale=d ** -0.5, tree=tree)
        serving |= keys()
    paged.warm_up("cpu", hq, hkv, d, torch.bfloat16, max_q_len=MAX_TRITON_Q_LEN, tree_q_len=paged.MAX_TILE_M // group)
    warm = keys()
    result[f"{hq}/{hkv}/{d}"] = {"missing": sorted(serving - warm), "serving": len(serving), "warm": len(warm)}
print(json.dumps(result))
"""


def _run(script: str) -> dict:
    return run_json(script, timeout=600)


@pytest.fixture(scope="module")
def variants() -> dict:
    return _run(KEYS)


def test_the_warm_up_launches_every_attention_variant_serving_meets(variants):
    for shape, v in variants.items():
        assert v["missing"] == [], (shape, v["missing"][:3])
        assert v["serving"] > 4, shape  # several tiles and merge widths met, each compiled at start-up


def test_unaligned_metadata_would_meet_variants_the_warm_up_has_not_compiled():
    """The check above can fail: kv_indices as a view 4 bytes past a boundary is another
    variant."""
    script = KEYS.replace('up = upload_int64(host, "cpu", int32_tail=len(host) - 4, packed=3)',
                          'up = upload_int64(host, "cpu", int32_tail=len(host) - 4, packed=3); '
                          'up[6] = torch.cat([up[6][:1], up[6]])[1:]')
    assert all(v["missing"] for v in _run(script).values())
