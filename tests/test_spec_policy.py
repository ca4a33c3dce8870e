"""The speculation policy: per batch size, speculate only while it measures faster."""

from __future__ import annotations

import pytest

from e2e_util import make_config, random_prompts
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.config import SchedulerConfig
from target_proc.spec_policy import SpecPolicy, WorkAheadPolicy


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


def _drive_work_ahead(policy, batch, ssd_s, sd_s, steps):
    """As the target worker drives it: a step's time follows the flag of the request two
    back, reported when the last three flags agree."""
    chosen, flags = [], [True, True, True]
    for _ in range(steps):
        if flags[-3] == flags[-2] == flags[-1]:
            policy.record(batch, flags[-1], ssd_s if flags[-2] else sd_s)
        flags.append(policy.work_ahead(batch))
        chosen.append(flags[-1])
    return chosen


def test_work_ahead_policy_keeps_ssd_where_it_is_faster():
    p = WorkAheadPolicy("auto", warmup=4, probe_len=4, probe_every=32)
    chosen = _drive_work_ahead(p, 1, ssd_s=0.020, sd_s=0.030, steps=200)
    first_sd = chosen.index(False)
    assert first_sd == 3 and chosen[3:7] == [False] * 4  # 4 SSD steps measured, then one SD probe
    assert chosen[7:].count(False) <= 4 * (len(chosen[7:]) // 32 + 1)  # only probes after that
    assert p.summary() == {1: "ssd"} and p.num_sync == chosen.count(False)


def test_work_ahead_policy_switches_to_sd_and_back():
    p = WorkAheadPolicy("auto", warmup=4, probe_len=4, probe_every=32)
    chosen = _drive_work_ahead(p, 16, ssd_s=0.040, sd_s=0.030, steps=100)
    assert chosen[-20:].count(True) <= 3 and p.summary() == {16: "sd"}
    chosen = _drive_work_ahead(p, 16, ssd_s=0.020, sd_s=0.030, steps=100)  # the draft got faster
    assert chosen[-20:].count(True) >= 17 and p.summary() == {16: "ssd"}
    assert p.summary().get(1) is None  # buckets are separate
    assert all(_drive_work_ahead(WorkAheadPolicy("always"), 16, ssd_s=1.0, sd_s=0.01, steps=20))
    with pytest.raises(ValueError):
        WorkAheadPolicy("never")


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
