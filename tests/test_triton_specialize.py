"""The sampling kernels (spec_runtime/kernels/race.py) compile once for every batch:
Triton's specialization of their arguments (a pointer aligned to 16 bytes or not, an
integer divisible by 16 or equal to 1) is the same at every batch size and speculation
length the target and the draft pass them, so no batch of a new size stops the loop for
a compile. Run in a fresh interpreter: the other kernel tests load Triton's interpreter,
which has no specialization."""

from __future__ import annotations

import json

import pytest
from fresh_python import run_json

pytest.importorskip("triton")

KEYS = r"""
import json, sys
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from spec_runtime.kernels import race
from spec_runtime.sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_TARGET, SamplingTensors, stream_key

TOP_K = 64

honour = sys.argv[1] == "flags"  # else: every argument specialized, as a plain @triton.jit

def key(kernel, args):
    params = [p for p in kernel.params if not p.is_constexpr]
    return [list(native_specialize_impl(BaseBackend, a, p.is_const, not (honour and p.do_not_specialize),
                                        not (honour and p.do_not_specialize_on_alignment)))
            for a, p in zip(args, params)]

target, accept, draft = (stream_key(s) for s in (STREAM_TARGET, STREAM_ACCEPT, STREAM_DRAFT))
keys = {"dense_race": [], "uniforms": [], "draft_race": []}
for b in (1, 2, 3, 4, 5, 16, 17):
    st = SamplingTensors.from_params([(0.7, 0, 1.0, 1000 + i) for i in range(b)])  # seed: a view into one upload
    positions = torch.arange(b, dtype=torch.int64) + 500
    keys["dense_race"].append(key(race._dense_race_kernel, race.dense_race_args(torch.rand(b, 1000), st.seed,
                                                                                 positions, target)[1]))
    for m in (1, 2, 4, 8):  # the accept test's uniforms over [B, m] drafts, as rejection.py draws them
        keys["uniforms"].append(key(race._uniform_kernel, race.uniforms_args(
            st.seed.unsqueeze(-1).expand(b, m), positions.unsqueeze(-1) + torch.arange(m), accept,
            torch.zeros(1, dtype=torch.int64))[1]))
    for m in (1, 2, 4, 8, TOP_K):
        keys["draft_race"].append(key(race._draft_race_kernel, race.draft_race_args(
            st.seed, positions, draft, torch.randint(0, 1000, (b, m)), torch.rand(b, m))[1]))
# The start-up warm-up's launches, with their constexprs (the draft's race at --draft-top-k).
warm = {name: [key(kernel, args), meta] for name, (kernel, grid, args, meta) in zip(
    ("dense_race", "uniforms", "draft_race"), race.warm_up_launches("cpu", 1000, TOP_K, target, accept, draft))}
serving_meta = {"dense_race": race.dense_race_args(torch.rand(3, 1000), st.seed[:3], positions[:3], target)[2],
                "uniforms": race.uniforms_args(st.seed, positions, accept, torch.zeros(1, dtype=torch.int64))[2],
                "draft_race": race.draft_race_args(st.seed, positions, draft, torch.zeros(b, TOP_K, dtype=torch.int64),
                                                   torch.rand(b, TOP_K))[2]}
print(json.dumps({"keys": keys, "warm": warm, "serving_meta": serving_meta}))
"""


def _keys(mode: str) -> dict:
    return run_json(KEYS, mode)


def test_each_sampling_kernel_has_one_specialization_for_every_batch():
    for name, keys in _keys("flags")["keys"].items():
        assert all(k == keys[0] for k in keys), (name, sorted({json.dumps(k) for k in keys}))
    # Specialized on everything, the same arguments would need several compiles each.
    assert all(len({json.dumps(k) for k in keys}) > 1 for keys in _keys("all")["keys"].values())


def test_the_start_up_warm_up_compiles_the_kernels_serving_launches():
    """sampling.warm_up_kernels launches each kernel once before serving: with the same
    specialization and constexprs as serving's launches, or the first step that needs one
    would still compile it."""
    out = _keys("flags")
    for name, keys in out["keys"].items():
        warm_key, warm_meta = out["warm"][name]
        assert warm_key == keys[-1], name  # draft_race: the last is at --draft-top-k
        assert warm_meta == out["serving_meta"][name], name
