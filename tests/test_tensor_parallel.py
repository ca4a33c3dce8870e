"""Tensor parallelism on the CPU (gloo): a target split over two processes computes what
one process computes, and the runtime built on it decodes the same tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from spec_runtime.config import ModelConfig
from spec_runtime.engine.forward_batch import ForwardItem
from spec_runtime.engine.parallel import pack_items, rank_device, unpack_items
from tests.conftest import save_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 9, 14, 3, 77, 120, 8, 41, 200]


def _items():
    """A prefill of PROMPT in slot 0, then a 3-token verify-like step continuing it."""
    n = len(PROMPT)
    prefill = ForwardItem(PROMPT, 0, np.arange(n, dtype=np.int64), "all")
    step = ForwardItem([7, 11, 13], n, np.arange(n + 3, dtype=np.int64), "all")
    return [prefill], [step]


def test_pack_and_unpack_round_trip():
    items = [ForwardItem([1, 2, 3], 4, np.arange(7, dtype=np.int64), "all"),
             ForwardItem(np.array([9]), 0, np.array([100], dtype=np.int64), "last"),
             ForwardItem([5, 6], 10, np.arange(12, dtype=np.int64) + 256, "none")]
    data = pack_items(items)
    assert data.dtype == np.int64 and data.ndim == 1
    back = unpack_items(data)
    for a, b in zip(items, back):
        assert list(a.token_ids) == list(b.token_ids) and a.start_pos == b.start_pos and a.logits == b.logits
        np.testing.assert_array_equal(a.kv_rows, b.kv_rows)
    with pytest.raises(ValueError, match="header describes"):
        unpack_items(np.concatenate([data, [0]]))


def test_rank_devices_follow_the_first():
    assert rank_device("cpu", 1) == "cpu"
    assert rank_device("cuda:2", 1) == "cuda:3" and rank_device("cuda", 3) == "cuda:3"


def test_config_refuses_a_split_draft_and_bad_sizes():
    from spec_runtime.config import RuntimeConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ModelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="draft runs on one device"):
        RuntimeConfig(draft=ModelConfig(path="x", tensor_parallel_size=2))


_RANK0 = r"""
import json, sys, numpy as np, torch
sys.path.insert(0, {root!r})
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from spec_runtime.engine.forward_batch import ForwardItem
from target_proc.model import start_tensor_parallel, target_runner
cfg = RuntimeConfig(target=ModelConfig(path={path!r}, tensor_parallel_size=2),
                    spec=SpeculativeConfig(mode="ar"), sched=SchedulerConfig(max_batch_size=2, max_model_len=64),
                    startup_timeout_s=120.0)
tp = start_tensor_parallel(cfg)
runner = target_runner(cfg, tp)
out = []
for items in {items!r}:
    its = [ForwardItem(t, s, np.asarray(r, dtype=np.int64), k) for t, s, r, k in items]
    out.append(runner.run(its).tolist())
tp.stop()
print(json.dumps(out))
"""


def _as_plain(items):
    return [(list(map(int, it.token_ids)), it.start_pos, it.kv_rows.tolist(), it.logits) for it in items]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_two_ranks_compute_the_logits_of_one(tmp_path, family):
    from spec_runtime.engine.runner import ModelRunner

    path = save_tiny_model(tmp_path / family, family)
    steps = _items()
    one = ModelRunner(ModelConfig(path=path), num_slots=2, max_model_len=64)
    want = [one.run(items) for items in steps]
    code = _RANK0.format(root=ROOT, path=path, items=[_as_plain(s) for s in steps])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for w, g in zip(want, got):
        torch.testing.assert_close(torch.tensor(g), w, atol=2e-5, rtol=1e-5)


def test_two_ranks_split_the_weights(tmp_path):
    """Each rank holds half of every split projection and the whole embedding."""
    from spec_runtime.models.loader import load_model

    path = save_tiny_model(tmp_path / "llama", "llama")
    whole, arch, _ = load_model(path)
    halves = [load_model(path, tp_size=2, tp_rank=r)[0] for r in (0, 1)]
    w = whole.layers[0].mlp.down_proj.weight  # [H, I]
    torch.testing.assert_close(torch.cat([h.layers[0].mlp.down_proj.weight for h in halves], dim=1), w)
    for h in halves:
        torch.testing.assert_close(h.embed_tokens.weight, whole.embed_tokens.weight)
        assert h.layers[0].self_attn.num_heads == arch.num_heads // 2
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        load_model(path, tp_size=3, tp_rank=0)


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    from tests.e2e_util import perturbed_copy

    d = tmp_path_factory.mktemp("tp")
    target = save_tiny_model(d / "target", "llama")
    return target, perturbed_copy(target, str(d / "draft"), noise=0.3)


def _generate(cfg, prompts, max_tokens=24):
    from protocol.messages import SamplingParams
    from spec_runtime.client import Client

    with Client(cfg) as client:
        res = client.generate_batch(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [r.token_ids for r in res]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_output_at_two_ranks_equals_one(tp_pair, mode):
    import dataclasses

    from tests.e2e_util import make_config

    target, draft = tp_pair
    cfg = make_config(target, draft if mode != "ar" else "", mode=mode, k=3)
    prompts = [PROMPT, PROMPT[:4] + [33, 34]]
    want = _generate(cfg, prompts)
    cfg2 = cfg.replace(target=dataclasses.replace(cfg.target, tensor_parallel_size=2))
    assert _generate(cfg2, prompts) == want


@pytest.mark.slow
def test_a_dead_rank_is_a_dead_target(tp_pair):
    import dataclasses

    import psutil

    from protocol.messages import SamplingParams
    from spec_runtime.client import Client
    from tests.e2e_util import make_config

    target, _ = tp_pair
    cfg = make_config(target, "", mode="ar")
    cfg = cfg.replace(target=dataclasses.replace(cfg.target, tensor_parallel_size=2))
    with Client(cfg) as client:
        followers = [p for p in psutil.Process().children(recursive=True)
                     if "target-rank" in " ".join(p.cmdline())]
        assert len(followers) == 1
        followers[0].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        err = None
        while time.monotonic() < deadline:
            try:
                client.generate_batch([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
            except Exception as e:  # noqa: BLE001 - the failure is what is tested
                err = e
                break
            time.sleep(0.5)
        assert err is not None, "requests kept succeeding after a rank died"
        assert "target" in str(err).lower()
