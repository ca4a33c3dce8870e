"""The spread a speculating step adds to a batch that drains (target_proc/drain.py): its
moments against the distributions they come from, its end-of-batch estimate against a
simulated drain, and the round policy's choice with and without a drain."""

from __future__ import annotations

import re

import numpy as np
import pytest

from target_proc.drain import acceptance, batch_drain, chain_moments, drained_rate, round_moments, spread_z
from target_proc.round_model import Costs, RoundPlan
from target_proc.round_policy import PLAIN, RoundPolicy, predict
from tests.test_round_policy import simulate


def _chain_pmf(x: float, n: int) -> np.ndarray:
    """P(J = j) for j = 0..n: j accepted tokens of an n-token chain, then a rejection (or none left)."""
    return np.array([x ** j * (1 - x) for j in range(n)] + [x ** n])


@pytest.mark.parametrize("x, n", [(0.6, 4), (0.8, 8), (0.3, 1), (1.0, 3)])
def test_chain_moments_are_the_distributions(x, n):
    pmf, j = _chain_pmf(x, n), np.arange(n + 1)
    assert pmf.sum() == pytest.approx(1.0)
    assert chain_moments(x, n) == pytest.approx(((pmf * j).sum(), (pmf * j * j).sum()))


def test_a_rounds_moments_mix_hits_and_misses():
    tokens, k, hit = 2.31, 4, 0.7
    x = acceptance(tokens, k)
    assert 1 + chain_moments(x, k)[0] == pytest.approx(tokens, abs=1e-6)
    full = _chain_pmf(x, k)
    j = np.arange(k + 1)
    # Backup none: a miss yields one token (J = 0).
    none = hit * full + (1 - hit) * np.eye(k + 1)[0]
    mean, var = round_moments("ssd", "none", tokens, hit, k)
    assert mean == pytest.approx(1 + (none * j).sum()) and var == pytest.approx((none * j * j).sum() - (none * j).sum() ** 2)
    # jit:1: a miss verifies a one-token chain.
    short = hit * full + (1 - hit) * np.concatenate([_chain_pmf(x, 1), np.zeros(k - 1)])
    mean, var = round_moments("ssd", "jit:1", tokens, hit, k)
    assert mean == pytest.approx(1 + (short * j).sum()) and var == pytest.approx((short * j * j).sum() - (short * j).sum() ** 2)
    # SD, halves and the jit backup verify a full chain, whatever the tree's hit rate.
    for kind, backup in (("sd", "none"), ("halves", "none"), ("ssd", "jit")):
        assert round_moments(kind, backup, tokens, hit, k) == pytest.approx((tokens, (full * j * j).sum() - (tokens - 1) ** 2))


@pytest.mark.parametrize("batch", [2, 4, 8, 32])
def test_spread_z_is_the_expected_largest_normal_sample(batch):
    rng = np.random.default_rng(0)
    largest = rng.standard_normal((20000, batch)).max(axis=1).mean()
    assert spread_z(batch) == pytest.approx(largest, rel=0.03)
    assert spread_z(1) == 0.0


@pytest.mark.parametrize("batch, hit", [(4, 0.7), (16, 0.8)])
def test_the_last_sequence_ends_where_the_model_says(batch, hit):
    """B sequences of 512 tokens decoded by rounds of SSD with backup none: the rounds until the last
    one ends, beyond the rounds the mean sequence needs, are the model's extra tokens over a."""
    tokens, k, left, trials = 2.31, 4, 512, 2000
    x = acceptance(tokens, k)
    pmf = hit * _chain_pmf(x, k) + (1 - hit) * np.eye(k + 1)[0]
    a, v = round_moments("ssd", "none", tokens, hit, k)
    rng = np.random.default_rng(1)
    rounds = int(left / a * 1.3)
    steps = 1 + rng.choice(k + 1, size=(trials, batch, rounds), p=pmf)
    done = (np.cumsum(steps, axis=2) >= left).argmax(axis=2) + 1  # each sequence's rounds to its end
    extra_rounds = done.max(axis=1).mean() - left / a
    model = spread_z(batch) * np.sqrt(v * left / a) / a
    assert extra_rounds == pytest.approx(model, rel=0.15)


def _costs(**kw) -> Costs:
    return Costs(tokens=2.31, plain_s=4 / 821, hit_rate={7: 0.7}, **kw)


def test_a_drain_rates_speculation_over_the_time_its_spread_adds():
    """8B/1B at alpha 0.6, batch 4, 128-token prompts: SSD rounds (7 branches, backup none) realized
    832 tok/s against plain steps' 821 (docs/benchmarks.md), and the drain at the end cost ~100 ms."""
    ssd, c, drain = RoundPlan("ssd", 7, "none"), _costs(), (512, 0.0)
    drained = drained_rate(832.0, ssd, 4, c, 4, drain)
    extra = 4 * 512 / drained - 4 * 512 / 832.0
    assert drained < 821 and 0.08 < extra < 0.13
    assert drained_rate(832.0, PLAIN, 4, c, 4, drain) == 832.0  # plain steps add no spread
    assert drained_rate(832.0, ssd, 1, c, 4, drain) == 832.0  # one sequence: nothing to wait for
    # Sequences already 20 tokens apart: the same rounds add less to the last one's end.
    assert drained < drained_rate(832.0, ssd, 4, c, 4, (512, 20.0)) < 832.0
    assert drained_rate(832.0, ssd, 4, c, 4, None) == 832.0  # a request waits
    assert drained_rate(None, ssd, 4, c, 4, drain) is None


def test_batch_drain_is_none_while_a_request_waits():
    assert batch_drain([10, 20, 30], waiting=1) is None and batch_drain([], 0) is None
    left, spread = batch_drain([10, 20, 30], 0)
    assert left == 30 and spread == pytest.approx(np.std([10, 20, 30]))


# At batch 4, SSD rounds of 16 branches with backup none: 3 of 4 hit, a = 7/3, 2 tokens per sequence
# per 9.7 ms (825 tok/s) against plain steps of 5 ms (800 tok/s); smaller trees no faster, SD slower.
SLIGHTLY_FASTER = dict(verify_s=0.0056, chain_s=0.012, work_s={16: 0.0097, 8: 0.0097, 4: 0.0097},
                       hit_rate={16: 0.75, 8: 0.5, 4: 0.25}, tokens=2.34, plain_s=0.005)


@pytest.mark.parametrize("drain, costs, steps", [
    (None, SLIGHTLY_FASTER, "ssd 16 branches, backup none"),  # a request waits: the 3% faster option
    ((512, 0.0), SLIGHTLY_FASTER, "plain"),  # the batch drains: 3% does not pay for the spread
    ((512, 0.0), dict(SLIGHTLY_FASTER, tokens=3.34), "ssd 16 branches, backup none"),  # 2.75 tokens: 42% faster
])
def test_a_draining_batch_speculates_only_where_the_gain_pays_for_the_spread(drain, costs, steps):
    """The bucket's choice is the same either way; a drain runs its steps plain where the spread the
    choice adds costs more than it gains."""
    p = RoundPolicy(lambda b: [16, 8, 4], probe_every=32, k=4)
    plans = simulate(p, 4, 300, drain=drain, **costs)
    assert p.summary() == {4: "ssd 16 branches, backup none"}
    assert sum(pl.label() == steps for pl in plans[-100:]) >= 80
    assert p.steps["plain"] == sum(pl == PLAIN for pl in plans)  # counted as what ran


def test_a_drain_near_its_end_runs_plain_steps_then_the_next_batch_speculates_again():
    """The last tokens of a batch pay least for a spread: plain steps there, and the choice (SSD
    rounds 42% faster) runs again for a batch whose requests wait or whose drain is long."""
    p = RoundPolicy(lambda b: [16, 8, 4], probe_every=32, k=4)
    phases = [(512, 0.0)] * 200 + [(4, 0.0)] * 20 + [None] * 20 + [(512, 0.0)] * 20
    plans = simulate(p, 4, len(phases), drain=phases.__getitem__, **dict(SLIGHTLY_FASTER, tokens=3.34))
    assert PLAIN not in plans[100:200] and plans[200:220].count(PLAIN) >= 18
    assert PLAIN not in plans[220:]
    assert p.summary() == {4: "ssd 16 branches, backup none"}


def _point_log(tmp_path, ssd_busy_s: float):
    """A gzip log of one point at batch 4 (bench_e2e's result line after its step records): plain
    steps of 5 ms (one at batch 2, 4.5 ms), SD rounds of 5.5 ms after a 12 ms chain, and SSD rounds
    of 16 branches with backup none, 3 of 4 sequences hitting with 7 tokens between them (2 tokens
    per sequence), each step ssd_busy_s."""
    import gzip

    from tests.test_round_policy import _step_records

    ssd, sd = RoundPlan("ssd", 16, "none"), RoundPlan("sd", 0, "")
    with _step_records() as lines:
        p = RoundPolicy(lambda b: [16], k=4)
        p.record(2, PLAIN, context=600, wait_s=0.0, busy_s=0.0045)
        for i in range(90):
            plan = PLAIN if i < 30 else ssd if i >= 40 else sd
            kw = dict(wait_s=0.0, busy_s=0.005) if plan == PLAIN else dict(
                wait_s=0.012, busy_s=0.0055, num_specs=4, num_drafted=4, drafted_tokens=9) if plan == sd else dict(
                wait_s=0.0, busy_s=ssd_busy_s, num_specs=4, num_hits=3, num_drafted=3, drafted_tokens=7,
                draft_work_s=0.004)
            p.record(4, plan, context=600 + i, **kw)
    text = "\n".join(ln for ln in lines if ln.startswith("step ")) + "\n[ssd] P=512 T=0.0 B=4: 800 tok/s\n"
    log = tmp_path / "steps.log.gz"
    log.write_bytes(gzip.compress(text.encode()))
    return log


@pytest.mark.parametrize("ssd_busy_s, told, blind", [
    (0.010, (0.93, 1.02), (0.9, 1.02)),  # SSD rounds as fast as plain steps: mostly plain steps
    (0.0068, (1.15, 1.5), (1.15, 1.5)),  # 47% faster: both run SSD rounds
])
def test_replay_drain_simulates_a_drained_batch_told_and_blind(tmp_path, capsys, ssd_busy_s, told, blind):
    """scripts/replay_drain.py on a log of one point: each policy's tokens/s against plain steps alone."""
    from tests.test_round_policy import _load_script

    replay_drain = _load_script("replay_drain")
    replay_drain.main([str(_point_log(tmp_path, ssd_busy_s)), "--levels", "16,8", "--k", "4", "--tokens", "128",
                       "--repeats", "3", "--batches", "4"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("steps.log.gz P=512 T=0.0 batch 4: told "), out
    m = re.search(r"plain alone ([\d.]+) \(told ([\d.]+)x, blind ([\d.]+)x; plain steps (\d+)%", out[0])
    assert float(m.group(1)) == pytest.approx(4 / 0.005)
    assert told[0] < float(m.group(2)) < told[1] and blind[0] < float(m.group(3)) < blind[1], out[0]
    assert (int(m.group(4)) > 50) == (ssd_busy_s == 0.010), out[0]
    assert out[1].startswith("1 points: against plain steps alone, told ")
    assert replay_drain.scale({4: 0.005, 2: 0.0045}, 4, 3) == pytest.approx(0.00475 / 0.005)


def test_no_periodic_probe_where_the_batch_ends_before_the_next_one():
    """Plain steps the choice (the verify cheap against the draft): a periodic probe every 32 steps
    (then further apart) runs the runner-up; none starts while the draining batch has fewer tokens
    left than DRAIN_PROBE_LEFT times that wait, and probes resume once a request waits."""
    costs = dict(verify_s=0.005, chain_s=0.030, work_s={16: 0.040, 8: 0.035, 4: 0.030},
                 hit_rate={16: 0.9, 8: 0.8, 4: 0.7}, tokens=2.0)
    phases = [None] * 100 + [(20, 0.0)] * 300 + [None] * 300
    p = RoundPolicy(lambda b: [16, 8, 4], probe_every=32, k=4)
    plans = simulate(p, 4, len(phases), drain=phases.__getitem__, **costs)
    assert p.summary() == {4: "plain"}
    assert all(pl == PLAIN for pl in plans[110:400]) and any(pl != PLAIN for pl in plans[400:])


def test_a_plain_step_slowed_beside_the_drafts_prefill_does_not_rule_plain_steps_out():
    """A draft on the target's GPU (SD rounds or plain steps): the one plain step measured before
    the first SD round took 10.4 ms (the draft's prefill beside it) against 5 ms since. A plain step
    takes at most an SD round's verify (5.6 ms), so plain steps rate close enough to SD rounds of
    12.4 ms for the first periodic probe to run them, and are found faster."""
    p = RoundPolicy(lambda b: [16, 8], allow_ssd=False, allow_halves=False, probe_every=32, k=4)
    p.record(4, PLAIN, wait_s=0.0, busy_s=0.005)
    p.record(4, PLAIN, wait_s=0.0, busy_s=0.0104)
    plans = []
    for _ in range(80):
        plan = p.choose(4)
        kw = dict(wait_s=0.0, busy_s=0.005) if plan == PLAIN else dict(
            wait_s=0.0068, busy_s=0.0056, num_specs=4, num_drafted=4, drafted_tokens=9)
        p.record(4, plan, **kw)
        plans.append(plan)
    assert plans[0] == RoundPlan("sd", 0, "") and p.summary() == {4: "plain"} and plans[40:70] == [PLAIN] * 30


def test_the_chain_wait_is_measured_from_the_second_sd_step_on():
    """The first SD round after plain steps waits for the draft to take in their outcomes too (on
    the target's GPU at once: 52.9 ms against about 8 ms, 8B/1B on one H200). Measured from it, c
    alone rated SD rounds below plain steps and the policy never ran them again; c comes from the
    SD rounds after it."""
    p = RoundPolicy(lambda b: [16, 8], allow_ssd=False, allow_halves=False, probe_every=32, k=4)
    sd = RoundPlan("sd", 0, "")
    p.record(4, PLAIN, wait_s=0.0, busy_s=0.005)
    p.record(4, PLAIN, wait_s=0.0, busy_s=0.005, sent=sd)  # a plain step whose outcomes ask for the next chain
    kw = dict(busy_s=0.0067, num_specs=4, num_drafted=4, drafted_tokens=14)
    p.record(4, sd, wait_s=0.0529, **kw)
    c = p.costs(4)
    assert c.chain_s is None
    p.record(4, sd, wait_s=0.008, **kw)
    assert c.chain_s == pytest.approx(0.008)
    assert predict(sd, 4, c, 4) > predict(PLAIN, 4, c, 4)
