"""The sampling kernels (spec_runtime/kernels/race.py) compile once for every batch:
Triton's specialization of their arguments (a pointer aligned to 16 bytes or not, an
integer divisible by 16 or equal to 1) is the same at every batch size and speculation
length the target and the draft pass them, so no batch of a new size stops the loop for
a compile. Run in a fresh interpreter: the other kernel tests load Triton's interpreter,
which has no specialization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

KEYS = r"""
import json, sys
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from spec_runtime.kernels import race
from spec_runtime.sampling import SamplingTensors

honour = sys.argv[1] == "flags"  # else: every argument specialized, as a plain @triton.jit

def key(kernel, args):
    params = [p for p in kernel.params if not p.is_constexpr]
    return [list(native_specialize_impl(BaseBackend, a, p.is_const, not (honour and p.do_not_specialize),
                                        not (honour and p.do_not_specialize_on_alignment)))
            for a, p in zip(args, params)]

keys = {"dense_race": [], "uniforms": [], "draft_race": []}
for b in (1, 2, 3, 4, 5, 16, 17):
    st = SamplingTensors.from_params([(0.7, 0, 1.0, 1000 + i) for i in range(b)])  # seed: a view into one upload
    positions = torch.arange(b, dtype=torch.int64) + 500
    keys["dense_race"].append(key(race._dense_race_kernel, race.dense_race_args(torch.rand(b, 1000), st.seed,
                                                                                 positions, 7)[1]))
    for m in (1, 2, 4, 8):
        drafts = torch.randint(0, 1000, (b, m + 1))[:, 1:]  # a view, as a verify's drafts
        keys["uniforms"].append(key(race._uniform_kernel, race.uniforms_args(st.seed, positions, 7, drafts)[1]))
        keys["draft_race"].append(key(race._draft_race_kernel, race.draft_race_args(
            st.seed, positions, 7, torch.randint(0, 1000, (b, m)), torch.rand(b, m))[1]))
print(json.dumps(keys))
"""


def _keys(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", KEYS, mode], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_each_sampling_kernel_has_one_specialization_for_every_batch():
    for name, keys in _keys("flags").items():
        assert all(k == keys[0] for k in keys), (name, sorted({json.dumps(k) for k in keys}))
    # Specialized on everything, the same arguments would need several compiles each.
    assert all(len({json.dumps(k) for k in keys}) > 1 for keys in _keys("all").values())
