"""The speculation policy: per batch size, speculate only while it measures faster."""

from __future__ import annotations

import pytest

from e2e_util import make_config, random_prompts
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.config import SchedulerConfig
from target_proc.spec_policy import SpecPolicy


def _drive(policy, batch, spec_rate, plain_rate, steps):
    chosen = []
    for _ in range(steps):
        spec = policy.use_speculation(batch)
        chosen.append(spec)
        policy.record(batch, spec, num_tokens=100, seconds=100 / (spec_rate if spec else plain_rate))
    return chosen


def test_always_speculates():
    p = SpecPolicy("always")
    assert all(_drive(p, 16, spec_rate=1.0, plain_rate=100.0, steps=20))


def test_adaptive_picks_the_faster_mode_and_keeps_probing():
    p = SpecPolicy("adaptive", probe_every=8, min_batch=4)
    chosen = _drive(p, 16, spec_rate=500.0, plain_rate=800.0, steps=64)
    assert chosen[0] is True and chosen[1] is False  # measure both first
    tail = chosen[8:]
    assert tail.count(True) <= (len(tail) // 8 + 1) * 3  # plain wins, speculation only probed
    assert p.num_plain_steps > 40
    # The regime changes (e.g. easier text): probes notice and speculation resumes.
    chosen = _drive(p, 16, spec_rate=2000.0, plain_rate=800.0, steps=64)
    assert chosen[-16:].count(True) >= 16 - 2 * p.probe_len  # two probes of plain decoding at most


def test_small_batches_always_speculate_and_buckets_are_separate():
    p = SpecPolicy("adaptive", probe_every=8, min_batch=4)
    assert all(_drive(p, 2, spec_rate=1.0, plain_rate=100.0, steps=10))
    _drive(p, 16, spec_rate=1.0, plain_rate=100.0, steps=10)
    assert p.use_speculation(5) is True  # bucket 8 has no measurements yet
    assert SpecPolicy.bucket(5) == 8 and SpecPolicy.bucket(16) == 16 and SpecPolicy.bucket(17) == 32


def test_bad_policy():
    with pytest.raises(ValueError):
        SpecPolicy("sometimes")
    with pytest.raises(ValueError):
        SchedulerConfig(spec_policy="sometimes")


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_plain_steps_keep_the_draft_in_sync(tiny_pair, ar_reference, mode):
    """Probing every 2 steps flips between plain and speculative steps all the time;
    output must stay exactly AR's, and speculation must keep working after plain steps."""
    target, draft = tiny_pair
    prompts = random_prompts(384)
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    ar = ar_reference(target, prompts, sp.max_tokens)
    cfg = make_config(target, draft, mode=mode, k=3)
    cfg = cfg.replace(sched=SchedulerConfig(max_batch_size=4, max_model_len=256, spec_policy="adaptive",
                                            spec_policy_probe_every=2))
    with Client(cfg) as client:
        res = client.generate_batch(prompts, sp)
        stats = client.engine_stats()
    assert [r.token_ids for r in res] == ar
    assert stats.num_plain_steps > 0
    assert stats.totals.num_accepted_tokens > 0
    assert stats.totals.num_ar_fallback_rounds == 0  # plain steps are not fallbacks: no re-sync needed
    if mode == "ssd":
        assert stats.totals.num_cache_hits > 0
