"""The draft timeout: configured, or measured from the draft's answers."""

from __future__ import annotations

import pytest

from conftest import save_tiny_model
from e2e_util import make_config
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from target_proc.draft_timeout import DraftTimeout


def test_configured_timeout_is_used_as_given():
    t = DraftTimeout(0.5)
    t.observe(3.0)
    assert t.value == 0.5


def test_measured_timeout_follows_the_slowest_recent_answer():
    t = DraftTimeout(None)
    assert t.value == DraftTimeout.INITIAL_S  # nothing measured yet
    t.observe(0.01)
    assert t.value == DraftTimeout.FLOOR_S  # fast answers: the floor
    t.observe(0.5)
    assert t.value == pytest.approx(DraftTimeout.FACTOR * 0.5)
    for _ in range(10):
        t.observe(0.01)  # one slow answer is remembered for a while...
    assert t.value == pytest.approx(DraftTimeout.FACTOR * 0.5 * DraftTimeout.DECAY ** 10)
    for _ in range(2000):
        t.observe(0.01)  # ...and forgotten eventually
    assert t.value == DraftTimeout.FLOOR_S


def test_runtime_measures_its_draft_timeout(tmp_path):
    target = save_tiny_model(tmp_path / "t", "llama")
    cfg = make_config(target, target, mode="sd", k=3, draft_timeout_s=None)
    with Client(cfg) as client:
        res = client.generate([5, 6, 7, 8], SamplingParams(max_tokens=16, ignore_eos=True))
        st = client.engine_stats()
    assert res.stats.num_draft_tokens > 0
    assert st.draft_timeout_s >= DraftTimeout.FLOOR_S and st.draft_timeout_s != DraftTimeout.INITIAL_S
