"""The SSD round policy's measurements under noise: a probe that comes close to the choice
runs until its realized rate rests on a full window, waits for steps that measure and
ends when the batch leaves its bucket, a few stalled steps in a row do
not rule out a plan whose steps otherwise take the same time each, one stalled plain
step does not hold up P, the choice last left is probed first, and a runner-up far behind
every other turn; and its host time: a
standing choice is ranked once in a few steps. Costs are injected (tests/test_round_policy.py's
simulated draft and target)."""

from __future__ import annotations

from itertools import groupby

import pytest

from target_proc.round_model import WINDOW, predict
from target_proc.round_policy import HALVES, MAX_HOLD, PLAIN, RANK_EVERY, SD, Costs, RoundPlan
from tests.test_round_policy import _policy, simulate

SLOW_TREES = dict(verify_s=0.0108, chain_s=0.0106, work_s={16: 0.034, 8: 0.030}, hit_rate={16: 0.8, 8: 0.75},
                  tokens=3.33)


def test_a_close_probe_runs_until_its_window_is_full():
    """SD leads SSD by about 5%. A periodic probe of SSD that loses by so little runs on
    until its realized rate rests on a full window (WINDOW steps after the first three of
    the switch) before the choice stands; a probe of plain decoding, 40% behind, does not."""
    p = _policy(levels=[16, 8], k=4, allow_halves=False, backup_auto=False)
    # SSD 16: 4a / (S + (W - S) + (1 - 0.9^4) c) = 4a / 22.5 ms; SD: 4a / 21.4 ms.
    costs = dict(SLOW_TREES, work_s={16: 0.0188, 8: 0.025}, hit_rate={16: 0.9, 8: 0.85})
    plans = simulate(p, 4, 600, **costs)
    assert p.summary() == {4: "sd"}
    probes = [(plan, len(list(g))) for plan, g in groupby(plans[100:]) if plan != SD]
    ssd = [n for plan, n in probes if plan.kind == "ssd"]
    assert ssd and all(n == WINDOW + 3 for n in ssd), probes
    assert all(n == 6 for plan, n in probes if plan.kind == "plain"), probes


@pytest.mark.parametrize("plan", [PLAIN, SD])
def test_a_few_stalled_steps_do_not_set_a_steady_plans_rate(plan):
    """Plain steps and SD rounds take about the same time each (8 ms here). Three steps in a
    row held up to 13-35 ms by the host are left out of the realized rate; an SSD round,
    which waits for the jit chain whenever a sequence misses, keeps steps up to 3x the
    median."""
    c = Costs(tokens=3.0)
    for s in [0.008, 0.008, 0.008, 0.008, 0.013, 0.033, 0.035]:
        c.add_realized(plan, 4, 4.0 if plan == PLAIN else 12.0, s)
    per_step = 4.0 if plan == PLAIN else 12.0
    assert c.realized_rate(plan, 4, 4) == pytest.approx(per_step / 0.008)
    ssd = RoundPlan("ssd", 16, "jit")
    c.hit_rate[16] = 0.9
    for s in [0.008, 0.008, 0.016, 0.008, 0.016]:
        c.add_realized(ssd, 4, 12.0, s)
    assert c.realized_rate(ssd, 4, 4) == pytest.approx(5 * 12.0 / 0.056)


def test_one_stalled_plain_step_does_not_keep_the_policy_off_plain_decoding():
    """At batch 4 plain steps take 7.4 ms (540 tok/s) and SD rounds 18.1 ms at 2 tokens per
    sequence (442 tok/s). The batch drains to 3, where one plain step stalls for 762 ms;
    at batch 4 again no plain step of that size is in the realized window, so plain
    decoding is rated from P, which the stall must not move: plain still rates above SD."""
    p = _policy(allow_ssd=False, allow_halves=False, k=4)
    costs = dict(verify_s=0.0083, chain_s=0.0098, work_s={}, hit_rate={}, tokens=2.0, plain_s=0.0074)
    assert simulate(p, 4, 80, **costs)[-20:].count(PLAIN) >= 18
    for busy in [0.0074] * 9 + [0.762]:
        p.choose(3)
        p.record(3, PLAIN, wait_s=0.0, busy_s=busy)
    c = p.costs(4)
    assert c.plain_s == pytest.approx(0.0074)
    assert predict(PLAIN, 4, c, 4) == pytest.approx(4 / 0.0074)
    assert predict(SD, 4, c, 4) == pytest.approx(8 / 0.0181)


def _steady_measure(c: Costs, measure: str):
    """(add a sample, read the value) of one of c's steady measurements: P, S (beside a
    work-ahead), H or W[16]."""
    return {
        "P": (c.add_plain, lambda: c.plain_s),
        "S": (lambda x: c.add_verify(True, x), lambda: c.verify_s[True]),
        "H": (c.add_halves, lambda: c.halves_s),
        "W": (lambda x: c.add_work(16, x), lambda: c.work_s[16]),
    }[measure]


@pytest.mark.parametrize("measure", ["P", "S", "H", "W"])
def test_a_steady_measurement_ignores_one_stall_and_follows_a_lasting_change(measure):
    """S, P, H and W[n] are the median of their last WINDOW samples: one stall among them
    does not move the value, a lasting change moves it within half a window."""
    c = Costs()
    add, read = _steady_measure(c, measure)
    for x in [0.008] * 4 + [0.762] + [0.008] * 2:
        add(x)
    assert read() == pytest.approx(0.008)
    for _ in range(WINDOW // 2 + 1):
        add(0.012)
    assert read() == pytest.approx(0.012)
    assert c.samples[("w", 16)] == (WINDOW // 2 + 8 if measure == "W" else 0)


@pytest.mark.parametrize("measure", ["P", "S", "H", "W"])
def test_with_two_samples_a_stall_does_not_set_a_steady_measurement(measure):
    """A halves probe at concurrency 32 yields one sample of H per probe (its fourth step).
    Two probes, the second a stall (46.6 ms against 20.5 ms): a median of the two would
    be their mean and rule halves out; below three samples the least stands, and from the
    third the median."""
    c = Costs()
    add, read = _steady_measure(c, measure)
    add(0.0466)
    assert read() == pytest.approx(0.0466)
    add(0.0205)
    assert read() == pytest.approx(0.0205)
    add(0.0210)
    assert read() == pytest.approx(0.0210)  # the median of three


def test_the_choice_last_switched_away_from_is_probed_first():
    """At batch 8 plain steps (7.4 ms, 1,081 tok/s) beat every other option (SSD 634-929,
    SD 884, halves 816). Seven plain steps held up to 20 ms by the host rate plain at 434,
    and the policy switches to the SSD tree of 8 without a backup. Its next periodic probe
    goes to plain, the choice it left, whose fresh steps win it back; by rank, plain would
    be probed once in four probes."""
    p = _policy(levels=[16, 8], k=4, probe_every=32, short_jit=1)
    costs = dict(verify_s=0.0083, chain_s=0.0098, work_s={16: 0.016, 8: 0.014}, hit_rate={16: 0.7, 8: 0.65},
                 tokens=2.0, plain_s=0.0074)
    assert simulate(p, 8, 300, **costs)[-50:].count(PLAIN) >= 44
    for _ in range(7):
        p.choose(8)
        p.record(8, PLAIN, wait_s=0.0, busy_s=0.020)
    assert predict(PLAIN, 8, p.costs(8), 4) < predict(SD, 8, p.costs(8), 4)
    assert simulate(p, 8, 150, **costs).count(PLAIN) >= 130


@pytest.mark.parametrize("plain_s,choice,waits", [(0.0074, SD, 16), (0.0050, PLAIN, 16), (0.0070, SD, 8)])
def test_a_far_slower_runner_up_is_probed_every_other_turn(plain_s, choice, waits):
    """Batch 4, SD rounds of 10.8 ms verify and 10.6 ms chain at 3.33 tokens a sequence (622
    tok/s) against plain steps of 7.4 ms (541 tok/s, 13% slower), 5.0 ms (800 tok/s: SD, the
    runner-up, is 22% slower) or 7.0 ms (571 tok/s, 8% slower). Once the waits have grown to
    8 x probe_every, a runner-up more than 10% slower is probed every other turn, 16 x
    probe_every steps apart; a closer one at every turn."""
    p = _policy(allow_ssd=False, allow_halves=False, k=4, probe_every=8)
    plans = simulate(p, 4, 1500, **dict(SLOW_TREES, plain_s=plain_s))
    assert p.summary() == {4: choice.kind}
    starts = [i for i in range(1, len(plans)) if plans[i] != choice and plans[i - 1] == choice]
    gaps = [b - a for a, b in zip(starts, starts[1:])][-3:]
    assert len(gaps) == 3 and all(waits * 8 <= g <= waits * 8 + 12 for g in gaps), starts


def test_a_probe_waits_for_steps_that_measure_and_ends_when_its_bucket_is_left():
    """Batch 16 at low acceptance: plain steps win. A periodic probe's steps do not run on
    steps that measure nothing (a sequence in its first rounds): plain steps run then, and
    the probe resumes once the batch is steady. A probe cut short by a drain to batch 2 is
    dropped: back at batch 16 (a new batch) its rest would realize nothing."""
    p = _policy(k=4)
    simulate(p, 16, 300, verify_s=0.010, chain_s=0.015, work_s={16: 0.030, 8: 0.025, 4: 0.020},
             hit_rate={16: 0.5, 8: 0.4, 4: 0.3}, tokens=1.5, plain_s=0.009)
    assert p.summary() == {16: "plain"}
    b = p._bucket(p.key(16, 0))
    b.probe.clear()
    b.hold, b.steps_since_probe, b.backoff, b.skipped = 0, 10**6, 1, True  # a periodic probe is due
    probed = p.choose(16)
    left = len(b.probe)
    assert probed != PLAIN and left >= 3
    assert [p.choose(16, steady=False) for _ in range(3)] == [PLAIN] * 3 and len(b.probe) == left
    assert p.choose(16) == probed and len(b.probe) == left - 1
    assert [p.choose(2) for _ in range(3)] == [PLAIN] * 3
    assert p.choose(16) == PLAIN and not b.probe and b.probed is None


def test_the_policys_host_time_is_counted_and_exported():
    """choose and record_step (the worker's calls) add their own time to host_s, which
    EngineStats carries as round_policy_s (bench_e2e.py's policy_ms_per_step)."""
    p = _policy(levels=[16, 8], k=4, allow_halves=False)
    assert p.engine_fields()["round_policy_s"] == 0.0
    simulate(p, 4, 50, **SLOW_TREES)
    first = p.engine_fields()["round_policy_s"]
    assert first > 0.0
    p.choose(4)
    assert p.engine_fields()["round_policy_s"] > first


def test_a_standing_choice_is_ranked_ever_less_often(monkeypatch):
    """Ranking every option is most of the policy's host time per step. A choice that
    stood RANK_EVERY rankings in a row runs RANK_EVERY steps per ranking, then twice as
    many at each ranking that keeps it, up to MAX_HOLD; a probe still comes on time."""
    import target_proc.round_policy as rp

    p = _policy(levels=[16, 8], k=4, allow_halves=False, backup_auto=False)
    simulate(p, 4, 300, **SLOW_TREES)  # SD stands (plain and SSD are probed now and then)
    calls = []
    monkeypatch.setattr(rp, "predict", lambda plan, *a, **kw: calls.append(plan) or predict(plan, *a, **kw))
    b = p._bucket(p.key(4, 0))
    b.probe.clear()
    b.probed, b.steps_since_probe, b.stood, b.hold, b.backoff = None, 0, 0, 0, 8  # the next probe far off
    options = len(p.options(4))
    ranked = []
    for _ in range(RANK_EVERY + 4 + 8 + 16 + 32 + 32):
        before = len(calls)
        assert p.choose(4) == SD
        ranked.append(len(calls) > before)
        p.record(4, SD, wait_s=0.0106, busy_s=0.0108, num_specs=4, num_drafted=4, drafted_tokens=13)
    # Ranked at each of the first RANK_EVERY steps, then after 4, 8, 16, 32 and 32 steps.
    gaps = [4, 8, 16, MAX_HOLD, MAX_HOLD]
    assert ranked == [True] * RANK_EVERY + [s for g in gaps for s in [False] * (g - 1) + [True]]
    assert len(calls) == options * ranked.count(True)
    # A probe due during a hold starts at the hold's end.
    b.steps_since_probe, b.backoff = 0, 1
    plans = [p.choose(4) for _ in range(p.probe_every + MAX_HOLD)]
    assert any(plan != SD for plan in plans)


def test_a_held_choice_the_batch_no_longer_offers_is_ranked_again():
    """Halves steps run from batch 8; batch 7 shares batch 8's bucket. A halves choice
    held there is not run at batch 7: the options are ranked at once."""
    p = _policy(levels=[16, 8], k=4)
    simulate(p, 8, 60, **SLOW_TREES)
    b = p._bucket(p.key(8, 0))
    b.probe.clear()
    b.probed, b.choice, b.hold = None, HALVES, RANK_EVERY - 1
    assert HALVES in p.options(8) and HALVES not in p.options(7)
    assert p.choose(8) == HALVES and b.hold == RANK_EVERY - 2
    assert p.choose(7) != HALVES
