"""The SSD round policy: per batch size, SSD rounds (tree shape, backup), SD rounds or plain
steps (and, from batch 8, SD rounds over halves of the batch), whichever the measured
costs predict fastest. Costs are injected (a simulated
draft and target), so nothing here depends on this machine's speed."""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter

import pytest

from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from target_proc.round_policy import (
    HALVES,
    PLAIN,
    SD,
    Costs,
    RoundPlan,
    RoundPolicy,
    SETTLE_STEPS,
    chain_tokens,
    model_rate,
    predict,
    short_jit_len,
)
from target_proc.round_model import HALVES_SLACK, WINDOW, halves_estimate, smaller_work

LEVELS = [16, 8, 4]


def _policy(levels=LEVELS, **kw) -> RoundPolicy:
    kw.setdefault("probe_every", 32)
    return RoundPolicy(lambda b: list(levels), **kw)


def _ranks(batch: int, n: int, hit_rate: dict) -> list[int]:
    """Ranks of the hits of a tree of n branches (DraftTokens.hit_rank) such that each smaller
    tree m of hit_rate holds round(hit_rate[m] * batch) of them."""
    ranks, below, rank = [], 0, 0
    for m in sorted(x for x in hit_rate if x < n) + [n]:
        hits = max(below, round(hit_rate[m] * batch))
        ranks += [rank] * (hits - below)  # first held by a tree of m: ranked at the smaller tree's size
        below, rank = hits, m
    return ranks


def simulate(policy, batch, steps, *, verify_s, chain_s, work_s, hit_rate, tokens=3.0, plain_s=None, halves=None,
             ranks=False, drain=None):
    """Drive the policy as the target worker does, with a draft and target of these costs:
    a step waits for the answer to the last request, from the tree built after the one
    before (its overrun, and the jit chain when any sequence missed) or a chain drafted
    on request. halves: (verify, chain) of half the batch (default: the whole batch's); a
    halves step waits for its half's chain beyond the other half's verify. ranks: the hits
    come with their ranks, as the draft's (smaller trees' hit rates as hit_rate gives them).
    drain: the batch's (left, spread) at every step, as the worker's (or a function of the step's
    index giving it). Returns the plans chosen."""
    plans, hist = [], [None, None]
    for step in range(steps):
        plan = policy.choose(batch, drain=drain(step) if callable(drain) else drain)
        p2, p1 = hist
        kw = dict(wait_s=0.0, busy_s=plain_s or verify_s)
        if plan == HALVES:
            v, c = halves or (verify_s, chain_s)  # by default a half costs as much as the whole
            half = batch // 2
            kw = dict(wait_s=max(0.0, c - v), busy_s=v, num_specs=half, num_drafted=half,
                      drafted_tokens=int(tokens * half), stepped=half)
        elif plan.speculate:
            if p2 is not None and p2.work_ahead:
                n = p2.branches or LEVELS[0]
                h, w = hit_rate[n], work_s[n]
                none, short = p1.backup == "none", short_jit_len(p1.backup)
                k = policy.k or 8
                chain = chain_s * ((short + 1) / (k + 1) if short else 1.0)
                wait = max(0.0, w - verify_s) + (0.0 if none else (1 - h ** batch) * chain)
                hits = round(h * batch)
                drafted = hits if none else batch
                missed = chain_tokens(tokens, k, short) if short else tokens
                kw = dict(wait_s=wait, busy_s=verify_s, num_specs=batch, num_hits=hits, num_drafted=drafted,
                          drafted_tokens=int(tokens * hits + missed * (drafted - hits)), draft_work_s=w,
                          hit_ranks=_ranks(batch, n, hit_rate) if ranks else None)
            else:
                kw = dict(wait_s=chain_s, busy_s=verify_s, num_specs=batch, num_drafted=batch,
                          drafted_tokens=int(tokens * batch))
        policy.record(batch, plan, **kw)
        plans.append(plan)
        hist = [p1, plan]
    return plans


FITS = dict(verify_s=0.020, chain_s=0.010, work_s={16: 0.015, 8: 0.012, 4: 0.010},
            hit_rate={16: 0.9, 8: 0.8, 4: 0.6})


def test_ssd_when_the_work_ahead_fits_inside_the_verify(caplog):
    p = _policy()
    with caplog.at_level(logging.INFO, logger="target_proc.round_policy"):
        plans = simulate(p, 1, 200, **FITS)
    best = RoundPlan("ssd", 16, "jit")
    assert plans[0] == best and SD in plans[:20]  # the largest tree first, then one probe of SD
    assert p.summary() == {1: best.label()}
    assert plans[-100:].count(best) >= 80  # the rest are probes of the runner-up
    assert RoundPlan("ssd", 8, "jit") not in plans  # it fits: no smaller tree is tried
    lines = [r.getMessage() for r in caplog.records if "batch size ~1" in r.getMessage()]
    assert len(lines) == 1 and "ssd 16 branches, backup jit" in lines[0]  # logged once
    assert sum(p.steps.values()) == p.steps["ssd"] + p.steps["sd"] + p.steps["plain"] == 200


def test_sd_when_the_work_ahead_is_slow():
    p = _policy()
    slow = dict(FITS, work_s={16: 0.045, 8: 0.040, 4: 0.038})
    plans = simulate(p, 1, 200, **slow)
    assert p.summary() == {1: "sd"}
    assert plans[-100:].count(SD) >= 80
    # The overrunning trees were measured smaller first, each found too slow.
    assert RoundPlan("ssd", 8, "jit") in plans and RoundPlan("ssd", 4, "jit") in plans
    c = p.costs(1)
    assert c.work_s[8] == pytest.approx(0.040) and c.chain_s == pytest.approx(0.010)


def test_plain_when_the_verify_is_cheap_against_the_draft():
    p = _policy()
    plans = simulate(p, 4, 200, verify_s=0.005, chain_s=0.030, work_s={16: 0.040, 8: 0.035, 4: 0.030},
                     hit_rate={16: 0.9, 8: 0.8, 4: 0.7}, tokens=2.0)
    assert p.summary() == {4: "plain"} and plans[-100:].count(PLAIN) >= 80
    assert p.costs(4).plain_s == pytest.approx(0.005)  # measured in a probe before it was chosen


def test_a_smaller_tree_when_the_largest_overruns_and_the_smaller_fits():
    p = _policy()
    costs = dict(verify_s=0.020, chain_s=0.010, work_s={16: 0.030, 8: 0.018, 4: 0.012},
                 hit_rate={16: 0.9, 8: 0.85, 4: 0.7})
    plans = simulate(p, 1, 200, **costs)
    assert p.summary() == {1: RoundPlan("ssd", 8, "jit").label()}
    assert RoundPlan("ssd", 4, "jit") not in plans  # 8 fits: no need to go smaller


def test_a_smaller_tree_is_rated_at_no_less_work_than_a_chain():
    """The next smaller tree below one that overruns is tried only if it could win at the
    larger tree's hit rate and the work smaller_work puts under it (a line from the chain's
    wait at one branch to the larger tree's work): at batch 16, alpha 0.6's costs on two
    H200s, a smaller tree with a jit backup waits for the chain on most rounds and cannot
    beat plain steps; with backup none it could, and is measured."""
    assert smaller_work(0.0146, 16, 8, 0.00675) == pytest.approx(0.00675 + 0.00785 * 7 / 15)
    assert smaller_work(0.0146, 16, 1, 0.00675) == pytest.approx(0.00675)
    assert smaller_work(0.0146, 16, 8, None) == 0.0  # c unmeasured: no floor
    assert smaller_work(0.004, 16, 8, 0.00675) == pytest.approx(0.004)  # never above the larger tree's
    p = _policy(k=4, short_jit=1)
    plans = simulate(p, 16, 80, verify_s=0.0074, chain_s=0.00675, work_s={16: 0.0146, 8: 0.0127, 4: 0.0094},
                     hit_rate={16: 0.95, 8: 0.9, 4: 0.8}, tokens=2.35, plain_s=0.005)
    assert RoundPlan("ssd", 8, "jit") not in plans and RoundPlan("ssd", 8, "jit:1") not in plans
    assert RoundPlan("ssd", 8, "none") in plans


def test_a_larger_trees_look_ups_rate_the_smaller_trees():
    """Each hit comes with its branch's rank, and a tree of n branches holds the forks of rank
    < n: the largest tree's rounds measure every smaller tree's hit rate. As above, where
    the smaller tree of 8 with backup none was measured at the largest tree's hit rate
    (0.95), it now rates at its own (10 of 16) and is not worth a probe."""
    assert _ranks(16, 16, {16: 0.95, 8: 0.9, 4: 0.8}) == [0] * 13 + [4, 8]
    costs = dict(verify_s=0.0074, chain_s=0.00675, work_s={16: 0.0146, 8: 0.0127, 4: 0.0094},
                 hit_rate={16: 0.95, 8: 0.6, 4: 0.5}, tokens=2.35, plain_s=0.005)
    p = _policy(k=4, short_jit=1)
    plans = simulate(p, 16, 80, **costs, ranks=True)
    assert p.costs(16).hit_rate[8] == pytest.approx(10 / 16) and p.costs(16).hit_rate[4] == pytest.approx(8 / 16)
    assert RoundPlan("ssd", 8, "none") not in plans and p.summary() == {16: "plain"}
    without = _policy(k=4, short_jit=1)
    assert RoundPlan("ssd", 8, "none") in simulate(without, 16, 80, **costs)
    # A hit of unknown rank (an answer without ranks) leaves the smaller trees' rates alone.
    c = Costs()
    c.add_hits(16, 3, 4, [0, -1, 9], [16, 8, 4])
    assert c.hit_rate == {16: 0.75}


def test_backup_none_at_large_batch_jit_at_small():
    costs = dict(verify_s=0.030, chain_s=0.020, work_s={16: 0.025, 8: 0.02, 4: 0.015},
                 hit_rate={16: 0.9, 8: 0.9, 4: 0.9})
    p = _policy()
    simulate(p, 16, 300, **costs)
    # One miss in 16 sequences (81% of rounds) makes everyone wait for a jit chain.
    assert p.summary() == {16: RoundPlan("ssd", 16, "none").label()}
    # At batch 1 a miss holds up only its own sequence: jit is the only backup.
    assert {o.backup for o in p.options(1) if o.kind == "ssd"} == {"jit"}
    simulate(p, 1, 300, **costs)
    assert p.summary()[1] == RoundPlan("ssd", 16, "jit").label()


def test_from_batch_2_the_backup_is_chosen_by_its_measured_cost():
    """At batch 4 one miss in four makes the batch wait for the chain: with the 8B/1B
    pair's costs (a 7.6 ms verify, an 8 ms chain, 0.75 of look-ups hit) answering misses
    with nothing yields more per second; with a 2 ms chain and half the look-ups missing,
    the chain's tokens are worth its wait."""
    slow_chain = dict(verify_s=0.0076, chain_s=0.008, work_s={16: 0.007, 8: 0.006, 4: 0.005},
                      hit_rate={16: 0.75, 8: 0.7, 4: 0.6}, tokens=3.4)
    p = _policy(k=4)
    assert {o.backup for o in p.options(2) if o.kind == "ssd"} == {"jit", "none"}
    simulate(p, 4, 400, **slow_chain)
    assert p.summary() == {4: RoundPlan("ssd", 16, "none").label()}
    fast_chain = dict(slow_chain, chain_s=0.002, hit_rate={16: 0.5, 8: 0.45, 4: 0.4})
    p = _policy(k=4)
    simulate(p, 4, 400, **fast_chain)
    assert p.summary() == {4: RoundPlan("ssd", 16, "jit").label()}


def test_a_short_jit_chain_wins_when_misses_are_common_and_the_chain_is_slow():
    # Batch 16, half the look-ups miss: a K-token chain for the misses costs 20 ms a
    # round, answering them with nothing loses their tokens; a 2-token chain is cheaper
    # than the first and yields more than the second.
    costs = dict(verify_s=0.030, chain_s=0.020, work_s={16: 0.020, 8: 0.015, 4: 0.012},
                 hit_rate={16: 0.5, 8: 0.4, 4: 0.3}, tokens=4.3)
    p = _policy(k=8, short_jit=2)
    assert [o.backup for o in p.options(16) if o.branches == 16] == ["jit", "jit:2", "none"]
    assert "jit:2" not in {o.backup for o in p.options(1)}  # batch 1: jit only
    simulate(p, 16, 400, **costs)
    assert p.summary() == {16: RoundPlan("ssd", 16, "jit:2").label()}
    # The model: a 2-token chain at the acceptance that gives 4.3 tokens at K = 8.
    assert chain_tokens(4.3, 8, 8) == pytest.approx(4.3, abs=1e-6)
    assert 2.3 < chain_tokens(4.3, 8, 2) < 2.6 and chain_tokens(1.0, 8, 2) == pytest.approx(1.0)
    # From the config: K // 4 tokens, none below K = 4.
    for k, short in ((8, 2), (4, 1), (3, 0)):
        rp = RoundPolicy.for_config(RuntimeConfig(spec=SpeculativeConfig(mode="ssd", k=k), draft=ModelConfig(path="x")))
        assert rp.short_jit == short
    with pytest.raises(ValueError, match="short_jit"):
        RoundPolicy(lambda b: [4], k=4, short_jit=4)


def test_the_choice_follows_the_costs_when_they_change():
    p = _policy(probe_every=16)
    slow = dict(FITS, work_s={16: 0.045, 8: 0.040, 4: 0.038})
    simulate(p, 1, 200, **slow)
    assert p.summary() == {1: "sd"}
    plans = simulate(p, 1, 300, **FITS)  # the draft got faster: probes of the runner-up notice
    assert p.summary()[1].startswith("ssd") and p.num_switches >= 1
    assert plans[-50:].count(SD) <= 15  # probes only (6 of every 22 steps)


def test_overrides_pin_what_they_name():
    p = _policy(levels=[16], allow_sd=False, allow_plain=False, allow_halves=False, backup_auto=False)
    assert p.options(16) == [RoundPlan("ssd", 0, "")]
    plans = simulate(p, 16, 100, verify_s=0.005, chain_s=0.030, work_s={16: 0.040}, hit_rate={16: 0.5})
    assert set(plans) == {RoundPlan("ssd", 0, "")}
    # From the config: --tree-budget and --tree-shape fixed pin the tree (--fan-out only shapes it); --backup
    # pins the backup; --work-ahead always and --spec-policy always drop SD and plain steps.
    spec = SpeculativeConfig(mode="ssd", k=4)
    assert spec.tree_levels(1) == [8, 4, 2] and not spec.tree_pinned  # 3,2,1,1,1 = 8 branches at most
    for pin in (dict(tree_budget=32), dict(tree_shape="fixed")):
        assert len(SpeculativeConfig(mode="ssd", k=4, **pin).tree_levels(1)) == 1
    assert SpeculativeConfig(mode="ssd", k=4, fan_out=(3,) * 5).tree_levels(1) == [15, 7, 3]
    cfg = RuntimeConfig(spec=SpeculativeConfig(mode="ssd", k=4, backup="ngram", work_ahead="always"),
                        sched=SchedulerConfig(spec_policy="always"), draft=ModelConfig(path="x"))
    rp = RoundPolicy.for_config(cfg)
    assert [o.kind for o in rp.options(16)] == ["ssd"] * 3 and {o.backup for o in rp.options(16)} == {""}
    default = RoundPolicy.for_config(RuntimeConfig(spec=SpeculativeConfig(mode="ssd", k=4),
                                                   draft=ModelConfig(path="x")))
    kinds = [o.kind for o in default.options(16)]
    assert kinds.count("ssd") == 9 and "sd" in kinds and "plain" in kinds  # 3 trees x jit, jit:1, none
    assert "halves" in kinds and "halves" not in [o.kind for o in default.options(2)]
    # --work-ahead halves: halves every step, a batch of one included (its own half).
    halves = RoundPolicy.for_config(RuntimeConfig(spec=SpeculativeConfig(mode="ssd", k=4, work_ahead="halves"),
                                                  draft=ModelConfig(path="x")))
    assert halves.options(16) == [HALVES] and halves.options(1) == [HALVES]
    # A draft on the target's GPU: no halves (its chains would compete with the verify).
    shared = RoundPolicy.for_config(RuntimeConfig(spec=SpeculativeConfig(mode="ssd", k=4),
                                                  target=ModelConfig(path="x", device="cuda:0"),
                                                  draft=ModelConfig(path="x", device="cuda:0")))
    assert "halves" not in [o.kind for o in shared.options(16)]


def test_predictions_follow_the_model():
    c = Costs(verify_s={True: 0.02, False: 0.02}, chain_s=0.01, work_s={8: 0.03}, hit_rate={8: 0.5}, tokens=3.0)
    c.samples[("w", 8)] = 5
    assert predict(SD, 2, c) == pytest.approx(2 * 3.0 / 0.03)
    assert predict(PLAIN, 2, c) == pytest.approx(2 / 0.02)  # P estimated as the verify
    # overrun 10 ms, P(any of 2 misses) = 0.75 -> 7.5 ms of jit chain
    assert predict(RoundPlan("ssd", 8, "jit"), 2, c) == pytest.approx(6.0 / (0.02 + 0.01 + 0.0075))
    assert predict(RoundPlan("ssd", 8, "none"), 2, c) == pytest.approx(2 * (0.5 * 3 + 0.5) / 0.03)
    assert predict(RoundPlan("ssd", 4, "jit"), 2, c) is None  # not measured
    with pytest.raises(ValueError):
        RoundPolicy(lambda b: [1], probe_every=1)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_greedy_output_is_ars_across_forced_switches(tiny_pair, ar_reference, overlap):
    """The default SSD policies with a probe every 2 steps, 8 sequences: SSD rounds (at
    several tree shapes), SD rounds, halves steps and plain steps alternate all the time;
    the output stays exactly AR's and every round of every request is accounted for.
    overlap on: plain steps are queued ahead (target_proc/ahead.py) between the others."""
    from e2e_util import make_config, random_prompts
    from protocol.messages import SamplingParams
    from spec_runtime.client import Client

    target, draft = tiny_pair
    prompts = random_prompts(384, lengths=(5, 9, 17, 30, 7, 12, 21, 3))
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    ar = ar_reference(target, prompts, sp.max_tokens, max_batch_size=8)
    cfg = make_config(target, draft, mode="ssd", k=3, work_ahead="auto", tree_shape="auto", spec_policy="adaptive")
    cfg = cfg.replace(sched=SchedulerConfig(max_batch_size=8, max_model_len=256, spec_policy="adaptive",
                                            spec_policy_probe_every=2, overlap_schedule=overlap))
    with Client(cfg) as client:
        # Two batches: one gives the policy too few steps at batch 8 for its probes (timed, so
        # not the same each run) to reach halves every time on a loaded CPU.
        runs = [client.generate_batch(prompts, sp) for _ in range(2)]
        stats = client.engine_stats()
    assert [[r.token_ids for r in res] for res in runs] == [ar, ar]
    res = runs[0] + runs[1]
    assert stats.num_ssd_rounds > 0 and stats.num_sd_rounds > 0 and stats.num_plain_steps > 0
    assert stats.num_halves_steps > 0
    assert stats.round_choices and all(isinstance(k, int) for k in stats.round_choices)
    assert 0 < stats.round_policy_s < stats.loop_s  # the policy's own host time, within the steps'
    assert set(stats.host_parts) == {"poll", "outcomes", "accept", "record", "verify_launch", "land"}
    assert (stats.num_steps_ahead > 0) == (overlap == "on")
    assert all(v > 0 for v in stats.host_parts.values()) and sum(stats.host_parts.values()) < stats.loop_s
    assert stats.host_parts["verify_launch"] < stats.verify_s  # the verify's part before its sync
    t = stats.totals
    assert t.num_cache_hits > 0 and t.num_sd_rounds > 0 and t.num_plain_rounds > 0 and t.num_ar_fallback_rounds == 0
    for r in res:  # the first token comes from the prefill, then each round is one of these
        s = r.stats
        assert s.num_rounds - 1 == (s.num_cache_hits + s.num_cache_misses + s.num_sd_rounds + s.num_plain_rounds
                                    + s.num_ar_fallback_rounds), s


def test_halves_steps_give_ars_greedy_output(tiny_pair, ar_reference):
    """--work-ahead halves: every step verifies one half of the batch while the draft
    chains the other. Prompts of different lengths finish apart (the halves rebalance);
    the output is AR's, every round is an SD round, and no answer waited for is lost to
    the other half's collect (no draft timeout)."""
    from e2e_util import make_config, random_prompts
    from protocol.messages import SamplingParams
    from spec_runtime.client import Client

    target, draft = tiny_pair
    prompts = random_prompts(384, lengths=(5, 9, 17, 30, 12))
    max_tokens = [40, 12, 33, 25, 20]
    ar = ar_reference(target, prompts, max_tokens)
    cfg = make_config(target, draft, mode="ssd", k=3, work_ahead="halves")
    with Client(cfg) as client:
        ids = [client.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, max_tokens)]
        res = [client._collect(i) for i in ids]
        stats = client.engine_stats()
    assert [r.token_ids for r in res] == ar
    assert stats.num_halves_steps > 0 and stats.num_ssd_rounds == stats.num_sd_rounds == 0
    assert stats.num_draft_timeouts == 0 and stats.round_choices and set(stats.round_choices.values()) == {"halves"}
    assert stats.totals.num_sd_rounds > 0 and stats.totals.num_accepted_tokens > 0
    for r in res:
        s = r.stats
        assert s.num_rounds - 1 == (s.num_cache_hits + s.num_cache_misses + s.num_sd_rounds + s.num_plain_rounds
                                    + s.num_ar_fallback_rounds), s


def test_engine_counters_and_the_choice_are_exported():
    from protocol.messages import EngineStats, RequestStats
    from spec_runtime.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", k=2)

    def scrape(**kw) -> dict[str, float]:
        engine = EngineStats(num_running=1, num_waiting=0, num_free_slots=3, draft_alive=True, mode="ssd",
                             totals=RequestStats(), **kw)
        out = {}
        for line in metrics.render(engine).decode().splitlines():
            if line.startswith("spec_runtime:") and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    m = scrape(num_ssd_rounds=10, num_sd_rounds=4, num_halves_steps=7, num_plain_steps=2, num_round_switches=1,
               draft_tree_shrinks=3, draft_tree_grows=1, round_choices={1: "ssd 8 branches, backup jit", 16: "sd"})
    lbl = '{model_name="m"}'
    assert m[f"spec_runtime:spec_decode_ssd_steps_total{lbl}"] == 10
    assert m[f"spec_runtime:spec_decode_sd_steps_total{lbl}"] == 4
    assert m[f"spec_runtime:spec_decode_halves_steps_total{lbl}"] == 7
    assert m[f"spec_runtime:spec_decode_plain_steps_total{lbl}"] == 2
    assert m[f"spec_runtime:spec_decode_round_policy_switches_total{lbl}"] == 1
    assert m[f"spec_runtime:spec_decode_tree_shrinks_total{lbl}"] == 3
    assert m[f"spec_runtime:spec_decode_tree_grows_total{lbl}"] == 1
    assert m['spec_runtime:spec_decode_round_choice{batch_size="16",choice="sd",model_name="m"}'] == 1
    # Counters follow the engine's totals; a restarted draft counts its tree moves from 0.
    m = scrape(num_ssd_rounds=15, num_sd_rounds=4, num_plain_steps=2, num_round_switches=2, draft_tree_shrinks=1,
               round_choices={16: "ssd 4 branches, backup none"})
    assert m[f"spec_runtime:spec_decode_ssd_steps_total{lbl}"] == 15
    assert m[f"spec_runtime:spec_decode_tree_shrinks_total{lbl}"] == 4
    assert m['spec_runtime:spec_decode_round_choice{batch_size="16",choice="ssd 4 branches, backup none",'
             'model_name="m"}'] == 1
    assert not any('choice="sd"' in k for k in m)  # the old choice is gone


def test_slow_first_rounds_do_not_rule_an_option_out():
    """The first rounds of each kind wait 0.3 s (a cold start): the realized rates of the
    later rounds, not a running mean of the first ones, decide."""
    p = _policy(levels=[16], probe_every=16)
    hist, plans, seen = [None, None], [], Counter()
    for _ in range(400):
        plan = p.choose(1)
        p2, p1 = hist
        seen[plan.kind] += 1
        slow = 0.3 if seen[plan.kind] <= 4 else 0.0
        kw = dict(wait_s=slow, busy_s=0.019)
        if plan.speculate:
            ssd = p2 is not None and p2.work_ahead
            kw.update(wait_s=slow + (0.13 * 0.010 if ssd else 0.010), num_specs=1, num_hits=int(ssd),
                      num_drafted=1, drafted_tokens=4, draft_work_s=0.015 + slow if ssd else 0.0)
        p.record(1, plan, **kw)
        plans.append(plan)
        hist = [p1, plan]
    assert p.summary()[1].startswith("ssd")
    assert sum(pl.kind == "ssd" for pl in plans[-100:]) >= 70  # a probe of 6 steps every 32 or more


def test_a_realized_rate_stands_in_for_the_model():
    """SD's realized rate: a over its steps' mean time, the stall (over 3x the median) left out."""
    c = Costs(verify_s={True: 0.02, False: 0.02}, chain_s=0.01, tokens=3.0)
    assert predict(SD, 1, c) == pytest.approx(3.0 / 0.03)
    for seconds in (0.05, 0.5, 0.06):
        c.add_realized(SD, 1, 3, seconds)
    assert predict(SD, 1, c) == pytest.approx(3.0 * 2 / 0.11)


def test_a_realized_rate_weighs_hit_and_miss_steps_by_the_long_run_hit_rate():
    """Eight SSD steps at batch 1 that happened to miss four times (10 ms a hit, 15 ms a
    miss): with 64 rounds of look-ups at 0.75, the step takes 0.75 x 10 + 0.25 x 15 ms, not
    the window's 12.5; from fewer look-ups, or with one kind of step only, the window's mean
    time stands. At batch 2 no sequence misses with chance 0.75 ** 2."""
    ssd = RoundPlan("ssd", 15, "jit")
    c = Costs(tokens=3.0)
    for i in range(8):
        c.add_realized(ssd, 1, 3, 0.015 if i % 2 else 0.010, missed=bool(i % 2))
    for i in range(1, 64):
        c.add_hits(15, int(i % 4 != 0), 1)
    assert c.realized_rate(ssd) == pytest.approx(3.0 / 0.0125)
    c.add_hits(15, 0, 1)  # 64 rounds: 48 hits
    assert c.realized_rate(ssd) == pytest.approx(3.0 / (0.75 * 0.010 + 0.25 * 0.015))
    assert c.realized_rate(ssd, batch=2) is None  # no step of about 2 sequences
    only_hits = RoundPlan("ssd", 7, "none")
    for _ in range(4):
        c.add_realized(only_hits, 1, 3, 0.010, missed=False)
    c.hit_rate[7] = 1.0
    assert c.realized_rate(only_hits) == pytest.approx(3.0 / 0.010)
    pair = Costs(tokens=3.0)
    for i in range(6):
        pair.add_realized(ssd, 2, 6, 0.015 if i % 2 else 0.010, missed=bool(i % 2))
    for _ in range(64):
        pair.add_hits(15, 3, 4)
    q = 0.75 ** 2
    assert pair.realized_rate(ssd) == pytest.approx(6.0 / (q * 0.010 + (1 - q) * 0.015))


def test_expected_tokens_take_the_long_run_hit_rate():
    """A tree whose last rounds happened to miss: a plan's expected tokens take h over the
    shape's last HITS_WINDOW rounds once WINDOW of them are in, not the running mean that
    follows the last few rounds (below WINDOW rounds, the running mean)."""
    none, short = RoundPlan("ssd", 7, "none"), RoundPlan("ssd", 7, "jit:1")
    c = Costs(tokens=3.0)
    for _ in range(WINDOW - 2):
        c.add_hits(7, 2, 2)
    c.add_hits(7, 0, 2)
    assert c.long_hit_rate(7) == pytest.approx(c.hit_rate[7])
    assert c.tokens_per_sequence(none) == pytest.approx(c.hit_rate[7] * 3.0 + (1 - c.hit_rate[7]))
    for _ in range(40):
        c.add_hits(7, 2, 2)
    for _ in range(4):
        c.add_hits(7, 0, 2)
    h = (2 * (WINDOW - 2) + 80) / (2 * (WINDOW - 1 + 44))
    assert c.hit_rate[7] < 0.7 < h == pytest.approx(c.long_hit_rate(7))
    assert c.tokens_per_sequence(none) == pytest.approx(h * 3.0 + (1 - h))
    assert c.tokens_per_sequence(short, 4) == pytest.approx(h * 3.0 + (1 - h) * chain_tokens(3.0, 4, 1))


def test_a_realized_rate_counts_expected_tokens_not_the_steps_own():
    """Three SD steps that happened to accept nothing: SD's rate is still a per step
    time, while a configured backup (whose tokens the model cannot tell) counts its own."""
    c = Costs(verify_s={True: 0.02, False: 0.02}, chain_s=0.01, tokens=4.0, hit_rate={8: 0.5})
    configured = RoundPlan("ssd", 8, "")
    for _ in range(3):
        c.add_realized(SD, 2, 2, 0.03)
        c.add_realized(configured, 2, 2, 0.02)
        c.add_realized(RoundPlan("ssd", 8, "none"), 2, 2, 0.02)
    assert c.realized_rate(SD) == pytest.approx(2 * 4.0 / 0.03)
    assert c.realized_rate(configured) == pytest.approx(2 / 0.02)
    assert c.realized_rate(RoundPlan("ssd", 8, "none")) == pytest.approx(2 * (0.5 * 4.0 + 0.5) / 0.02)


def test_ssd_holds_at_batch_1_when_each_steps_tokens_scatter():
    """Batch 1, K = 8: a step yields 1 to 9 tokens (acceptance 0.8 per position), SSD steps
    take 27 ms (37 ms on a miss, 15% of them), SD steps 38 ms and plain steps 26.5 ms.
    SSD is ~1.3x SD; the policy stays on it apart from its probes."""
    import random

    rng = random.Random(0)
    p = _policy(levels=[27], probe_every=64, k=8)
    hist, plans = [None, None], []
    for _ in range(1500):
        plan = p.choose(1)
        p2, p1 = hist
        tokens = 1
        while tokens < 9 and rng.random() < 0.8 ** (1 + 0.35 * (tokens - 1)):
            tokens += 1
        if not plan.speculate:
            kw = dict(wait_s=0.0, busy_s=0.0265)
        elif p2 is not None and p2.work_ahead:
            hit = rng.random() < 0.85
            kw = dict(wait_s=0.0006 if hit else 0.0106, busy_s=0.0265, num_specs=1, num_hits=int(hit),
                      num_drafted=1, drafted_tokens=tokens, draft_work_s=0.017)
        else:
            kw = dict(wait_s=0.0115, busy_s=0.0265, num_specs=1, num_drafted=1, drafted_tokens=tokens)
        p.record(1, plan, **kw)
        plans.append(plan)
        hist = [p1, plan]
    assert p.summary()[1].startswith("ssd")
    assert sum(pl.kind == "ssd" for pl in plans[-1000:]) >= 850


def test_steps_of_sequences_in_their_first_rounds_measure_nothing():
    p = _policy(levels=[16])
    for _ in range(3):
        p.record(1, PLAIN, wait_s=0.5, busy_s=0.5, steady=False)
    c = p.costs(1)
    assert c.plain_s is None and c.realized_rate(PLAIN) is None
    for _ in range(3):
        p.record(1, PLAIN, wait_s=0.0, busy_s=0.02)
    assert c.realized_rate(PLAIN) == pytest.approx(50.0)


def test_costs_are_kept_per_context_length():
    """A batch at 8K tokens of context does not inherit the rates measured at 512: the
    long-context bucket measures its own (here SD wins there, SSD at 512)."""
    p = _policy()
    simulate(p, 1, 150, **FITS)
    assert p.summary() == {1: RoundPlan("ssd", 16, "jit").label()}
    slow = dict(FITS, work_s={16: 0.045, 8: 0.040, 4: 0.038})
    hist = [None, None]
    for _ in range(200):  # the same policy, at 8192 tokens of context, where the draft is slow
        plan = p.choose(1, 8192)
        p2, p1 = hist
        kw = dict(wait_s=0.0, busy_s=slow["verify_s"])
        if plan.speculate:
            ssd = p2 is not None and p2.work_ahead
            n = p2.branches if ssd else 0
            kw = dict(wait_s=(max(0.0, slow["work_s"][n] - 0.020) + 0.1 * 0.010) if ssd else 0.010, busy_s=0.020,
                      num_specs=1, num_hits=int(ssd), num_drafted=1, drafted_tokens=3,
                      draft_work_s=slow["work_s"][n] if ssd else 0.0)
        p.record(1, plan, context=8192, **kw)
        hist = [p1, plan]
    assert p.summary() == {1: "sd"}  # the choice at the context of the last step
    assert p.costs(1).realized_rate(RoundPlan("ssd", 16, "jit")) > p.costs(1, 8192).realized_rate(SD)
    assert p.costs(1, 8192).chain_s == pytest.approx(0.010) and p.key(1, 100) == p.key(1, 1000) == (1, 1024)


def test_a_doubling_context_starts_from_the_costs_and_choice_it_leaves(caplog):
    """The batch's context grows past 1024 tokens: the next bucket starts from the costs
    and choice of the one it leaves (a copy), with no first measurements (the largest tree
    would run first, at batch 4 with backup none); a jump past the next bucket measures afresh."""
    p = _policy()
    simulate(p, 4, 200, verify_s=0.005, chain_s=0.030, work_s={16: 0.040, 8: 0.035, 4: 0.030},
             hit_rate={16: 0.9, 8: 0.8, 4: 0.7}, tokens=2.0)
    assert p.summary() == {4: "plain"}
    with caplog.at_level(logging.INFO, logger="target_proc.round_policy"):
        assert p.choose(4, 1500) == PLAIN
    assert "batch size ~4, context up to 2048 tokens: plain, from the costs up to 1024 tokens" in caplog.text
    before, after = p.costs(4), p.costs(4, 1500)
    assert after is not before and after.plain_s == before.plain_s and after.work_s == before.work_s
    for _ in range(2):  # the first step in the bucket measures nothing (the step before was another's)
        p.record(4, PLAIN, context=1500, wait_s=0.0, busy_s=0.006)
    assert list(after.steady["P"])[-1] == 0.006 and list(before.steady["P"])[-1] == 0.005  # its own from here
    assert p.choose(4, 8192) == RoundPlan("ssd", 16, "none")  # 2048 -> 8192: not the next bucket


def test_one_slow_step_does_not_set_a_realized_rate():
    """A first-use stall (a kernel built on the first SD round) among the first steps of an
    option: no rate from two steps, and with a third it is left out (over 3x the median)."""
    c = Costs(verify_s={True: 0.02, False: 0.02}, chain_s=0.01, tokens=3.0)
    c.add_realized(SD, 1, 3, 0.6)  # 5 tok/s
    c.add_realized(SD, 1, 3, 0.015)
    assert c.realized_rate(SD) is None and predict(SD, 1, c) == pytest.approx(100.0)
    c.add_realized(SD, 1, 3, 0.015)
    assert c.realized_rate(SD) == pytest.approx(200.0)


def test_a_slow_first_probe_does_not_rule_out_the_fastest_option():
    """SD is fastest, but the steps of its first probe ran slow (a kernel built on first
    use, a work-ahead still finishing): the model still predicts it fastest, so a later
    probe measures it afresh and the policy settles on it."""
    p = _policy()
    record, seen = p.record, Counter()

    def slow_first_sd_steps(batch, plan, **kw):
        if plan == SD and seen[plan] < 5:
            seen[plan] += 1
            kw["wait_s"] = kw.get("wait_s", 0.0) + {3: 0.6, 4: 0.03}.get(seen[plan], 0.0)
        record(batch, plan, **kw)

    p.record = slow_first_sd_steps
    # SSD 71 tok/s, SD 100 (50 as its first probe measured it), plain 50.
    slow = dict(FITS, work_s={16: 0.045, 8: 0.040, 4: 0.038})
    plans = simulate(p, 1, 300, **slow)
    assert seen[SD] == 5 and p.summary() == {1: "sd"}
    # Re-probed at the first periodic probe (step ~50), not when its turn comes round.
    assert plans[100:200].count(SD) >= 80


@pytest.mark.parametrize("target_dev, draft_dev, work_ahead, ssd", [
    ("cuda:0", "cuda:0", "auto", False),   # one GPU: the work-ahead would slow the verify
    ("cuda:0", "cuda:1", "auto", True),    # its own GPU
    ("cuda:0", "cuda:0", "always", True),  # pinned
    ("cpu", "cpu", "auto", True),
    ("cuda:0", "cuda:1", "halves", False),  # halves only
])
def test_no_ssd_rounds_for_a_draft_on_the_targets_gpu(target_dev, draft_dev, work_ahead, ssd):
    """...and the launcher has the draft prefetch no tree for a new sequence there: nothing would
    look it up, and it would run beside the target."""
    from spec_runtime.launcher import child_config

    cfg = RuntimeConfig(spec=SpeculativeConfig(mode="ssd", k=4, work_ahead=work_ahead),
                        target=ModelConfig(path="t", device=target_dev), draft=ModelConfig(path="x", device=draft_dev))
    assert cfg.draft_shares_target_gpu == (target_dev == draft_dev == "cuda:0")
    assert cfg.ssd_rounds_possible == ssd and child_config(cfg).spec.ssd_prefetch == ssd
    kinds = {o.kind for o in RoundPolicy.for_config(cfg).options(4)}
    assert ("ssd" in kinds) == ssd and ("sd" in kinds) == (work_ahead == "auto")
    if not ssd and work_ahead == "auto":
        p = RoundPolicy.for_config(cfg)
        simulate(p, 4, 50, **FITS)
        assert p.steps["ssd"] == 0 and p.summary()[4] == "sd"


def test_the_first_chain_after_ssd_rounds_does_not_count_against_sd():
    """Batch 32, K = 4: SD rounds (20.6 ms a step) beat every SSD option, whose 16.5 ms
    work-ahead overruns the 11.3 ms verify. The first chain after SSD rounds also feeds
    the last hit's branch (25 ms more), a cost of the switch: counted as SD's, it made
    SD look slower than SSD with no backup, and the policy kept SSD rounds."""
    verify, work, chain, catch_up, h, a, batch = 0.0113, 0.0165, 0.0093, 0.025, 0.6, 3.37, 32
    p = _policy(levels=[4], k=4, short_jit=1, allow_halves=False)
    hist, plans = [None, None, None], []
    for _ in range(600):
        plan = p.choose(batch)
        p3, p2, p1 = hist
        if not plan.speculate:
            kw = dict(wait_s=0.0, busy_s=0.0086)
        elif p2 is not None and p2.work_ahead:
            none, short = p1.backup == "none", short_jit_len(p1.backup)
            hits = round(h * batch)
            drafted = hits if none else batch
            missed = chain_tokens(a, 4, short) if short else a
            wait = work - verify + (0.0 if none else chain * ((short + 1) / 5 if short else 1.0))
            kw = dict(wait_s=wait, busy_s=verify, num_specs=batch, num_hits=hits, num_drafted=drafted,
                      drafted_tokens=round(a * hits + missed * (drafted - hits)), draft_work_s=work)
        else:
            extra = catch_up if p3 is not None and p3.work_ahead else 0.0
            kw = dict(wait_s=chain + extra, busy_s=verify, num_specs=batch, num_drafted=batch,
                      drafted_tokens=round(a * batch))
        p.record(batch, plan, **kw)
        plans.append(plan)
        hist = [p2, p1, plan]
    assert p.summary()[32] == "sd"
    assert sum(pl.kind == "sd" for pl in plans[-300:]) >= 220


def test_a_rate_realized_at_another_batch_size_does_not_stand_for_this_one():
    """Batches of 9 and 16 share a bucket. SD ran while the batch was filling: 9 sequences,
    22 ms a step (1,360 tok/s). At 16, SD takes 21.4 ms a step (2,490 tok/s) and SSD rounds,
    whose work-ahead slows the verify, 25 ms (2,130 tok/s at 3.33 tokens a sequence). The
    rate realized at 9 must not rank SD at 16."""
    c = Costs(verify_s={True: 0.0108, False: 0.0108}, chain_s=0.0106, tokens=3.33)
    for _ in range(3):
        c.add_realized(SD, 9, 30, 0.022)
    assert predict(SD, 9, c, 4) == pytest.approx(9 * 3.33 / 0.022)
    assert predict(SD, 16, c, 4) == pytest.approx(16 * 3.33 / 0.0214)  # the model: none realized at 16
    assert predict(SD, 10, c, 4) == pytest.approx(9 * 3.33 / 0.022)  # 9 is within an eighth of 10: it stands

    a, p = 3.33, _policy(levels=[8], k=4, probe_every=64, allow_halves=False)
    hist, plans = [None, None], []
    for step in range(400):
        batch = 9 if step < 60 else 16
        plan = p.choose(batch)
        p2, p1 = hist
        if not plan.speculate:
            kw = dict(wait_s=0.0, busy_s=0.0095)
        elif p2 is not None and p2.work_ahead:
            kw = dict(wait_s=0.003, busy_s=0.022, num_specs=batch, num_hits=batch, num_drafted=batch,
                      drafted_tokens=round(a * batch), draft_work_s=0.025)
        else:
            kw = dict(wait_s=0.0112 if batch == 9 else 0.0106, busy_s=0.0108, num_specs=batch, num_drafted=batch,
                      drafted_tokens=round(a * batch))
        p.record(batch, plan, **kw)
        plans.append(plan)
        hist = [p1, plan]
    assert all(pl.kind == "sd" for pl in plans[60:70])  # from the first steps at 16
    assert sum(pl.kind == "sd" for pl in plans[-200:]) >= 170


def test_probes_that_change_nothing_space_out():
    """Batch 16: SD (2,490 tok/s) beats every SSD option (1,900 at most). Each probe of
    an SSD option costs its steps and two switches; after probes that change nothing the
    next comes later (up to 8x probe_every), and once the costs move it probes at the full
    rate again."""
    p = _policy(levels=[16, 8], k=4, probe_every=32, allow_halves=False)
    slow = dict(verify_s=0.0108, chain_s=0.0106, work_s={16: 0.034, 8: 0.030}, hit_rate={16: 0.8, 8: 0.75},
                tokens=3.33)
    plans = simulate(p, 16, 1200, **slow)
    assert p.summary() == {16: "sd"}
    assert sum(pl.kind != "sd" for pl in plans[-600:]) <= 20  # 6-step probes, 256 steps apart
    assert p._buckets[p.key(16, 0)].backoff == 8
    fast = dict(slow, work_s={16: 0.010, 8: 0.008}, hit_rate={16: 0.95, 8: 0.9})  # the draft got faster
    plans = simulate(p, 16, 600, **fast)
    assert p.summary()[16].startswith("ssd")
    assert sum(pl.kind == "ssd" for pl in plans[-200:]) >= 170


def _load_script(name: str):
    """scripts/<name>.py as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_replay():
    return _load_script("replay_round_policy")


@contextlib.contextmanager
def _step_records():
    """The policy's messages as it logs them at DEBUG (step records among them), while open."""
    records = logging.getLogger("target_proc.round_policy")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    keep, level = Keep(), records.level
    records.addHandler(keep)
    records.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        records.removeHandler(keep)
        records.setLevel(level)


def test_replay_reads_step_records_and_prints_the_rates(tmp_path, capsys):
    """scripts/replay_round_policy.py: DEBUG step records in, each option's rate out
    wherever the recorded plan changes."""
    replay = _load_replay()
    with _step_records() as lines:
        logged = _policy(levels=[16, 8], k=4)
        for i in range(12):
            plan = SD if i < 6 else RoundPlan("ssd", 8, "jit")
            logged.record(4, plan, context=600 + i, wait_s=0.010, busy_s=0.020, num_specs=4,
                          num_hits=4 if i >= 8 else 0, num_drafted=4, drafted_tokens=12,
                          draft_work_s=0.015 if i >= 6 else 0.0)
    log = tmp_path / "steps.log"
    log.write_text("\n".join(["unrelated line"] + [ln for ln in lines if ln.startswith("step ")]) + "\n")
    replay.main([str(log), "--batch", "4", "--levels", "16,8", "--k", "4"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("context 600, runs sd")
    assert out[1].startswith("context 606, runs ssd 8 branches, backup jit: sd 400")  # 4 x 3 tokens / 30 ms
    replay.main([str(log), "--batch", "4", "--levels", "16,8", "--k", "4", "--time"])
    timed = capsys.readouterr().out.splitlines()
    assert timed[:2] == out and re.fullmatch(r"RoundPolicy\.choose: [\d.]+ us per step over 12 steps", timed[2])
    with pytest.raises(ValueError, match="unknown plan"):
        replay.parse_plan("tree of 8")
    # A plain step queued ahead runs fewer sequences when one ends by length.
    assert replay.parse_plan("plain (3 run)") == (PLAIN, 3, None)
    assert replay.parse_plan("halves (2 run)") == (HALVES, 2, None)
    assert replay.parse_plan("ssd 8 branches, backup jit:1") == (RoundPlan("ssd", 8, "jit:1"), 0, None)


def test_a_step_record_names_its_hits_ranks_and_still_reads_back():
    replay = _load_replay()
    with _step_records() as lines:
        _policy(k=4).record(4, RoundPlan("ssd", 16, "none"), wait_s=0.001, busy_s=0.009, num_specs=4, num_hits=2,
                            num_drafted=2, drafted_tokens=6, draft_work_s=0.008, hit_ranks=[5, 0])
    (line,) = [ln for ln in lines if ln.startswith("step ")]
    assert line.endswith("work-ahead 8.00 ms, ranks 0 5")
    batch, _, _, plan, kw, tokens = replay.parse_record(line)
    assert (batch, plan, kw["num_hits"], kw["num_specs"], tokens) == (4, RoundPlan("ssd", 16, "none"), 2, 4, 8)
    assert kw["hit_ranks"] == [0, 5]  # a replay feeds them to its policy as the engine does
    assert replay.parse_record(line.split(", ranks")[0])[4]["hit_ranks"] is None


def test_a_plain_step_that_requests_the_next_plan_is_logged_and_replayed_so(tmp_path):
    """A plain step queued ahead sends its outcomes with the next SSD round's request
    (target_proc/ahead.py): its record names that plan, the replay reads it back, and the
    policy reads the next step's answer as one a work-ahead ran beside."""
    replay = _load_replay()
    ssd = RoundPlan("ssd", 8, "none")
    with _step_records() as lines:
        p = _policy(levels=[16, 8], k=4)
        for sent in (None, ssd):
            p.record(4, PLAIN, context=600, wait_s=0.0, busy_s=0.006, sent=sent)
        p.record(4, ssd, context=601, wait_s=0.001, busy_s=0.010, num_specs=4, num_drafted=4, drafted_tokens=8)
    assert lines[1].startswith("step batch 4 context 600: plain (requests ssd 8 branches, backup none), wait")
    log = tmp_path / "steps.log"
    log.write_text("\n".join(lines) + "\n")
    records = list(replay.step_records(log))
    assert [kw["sent"] for *_, kw, _ in records] == [None, ssd, None]
    assert replay.parse_plan("plain (3 run) (requests sd)") == (PLAIN, 3, SD)
    # The SSD round's verify ran beside the work-ahead its lead-in request started.
    assert p.costs(4, 601).verify_s == {True: pytest.approx(0.010), False: None}


def test_plain_decoding_is_measured_when_its_floor_estimate_comes_close():
    """Before a plain step has run, its rate is estimated with P taken as a speculating
    step's verify, a floor: a plain step verifies one token per sequence. At low
    acceptance and large batch the one-token step is what wins, so it is measured
    (and then chosen) though its floor estimate ranks below SD."""
    p = _policy(k=4, short_jit=1)
    slow_trees = dict(verify_s=0.010, chain_s=0.002, work_s={16: 0.030, 8: 0.025, 4: 0.022},
                      hit_rate={16: 0.6, 8: 0.5, 4: 0.4}, tokens=1.35)
    # SD: 32 x 1.35 / 12 ms = 3600 tok/s; plain 32 / 7.5 ms = 4267, its floor 32 / 10 ms = 3200.
    plans = simulate(p, 32, 200, plain_s=0.0075, **slow_trees)
    assert PLAIN in plans[:40]
    assert p.costs(32).plain_s == pytest.approx(0.0075)
    assert p.summary() == {32: "plain"} and plans[-100:].count(PLAIN) >= 80


def test_plain_decoding_is_not_probed_when_even_its_slack_leaves_it_behind():
    p = _policy()
    plans = simulate(p, 1, 200, plain_s=0.018, **FITS)  # SSD 150 tok/s; plain's floor 50, 75 with the slack
    assert PLAIN not in plans


# Batch 32 at a long context: the verify and the chain both grow with the batch, so two
# half-batch verifies cost little more than one whole and each hides the other's chain.
LONG = dict(verify_s=0.025, chain_s=0.030, work_s={16: 0.060, 8: 0.050, 4: 0.045},
            hit_rate={16: 0.7, 8: 0.6, 4: 0.5})


def test_halves_when_each_halfs_chain_hides_behind_the_other_halfs_verify():
    p = _policy()
    plans = simulate(p, 32, 300, **LONG, halves=(0.016, 0.017))
    assert p.summary() == {32: "halves"} and plans[-100:].count(HALVES) >= 80
    # Its realized rate: 16 sequences x 3 tokens per 17 ms step.
    assert predict(HALVES, 32, p.costs(32)) == pytest.approx(16 * 3 / 0.017, rel=0.01)
    assert p.steps["halves"] == plans.count(HALVES) == p.engine_fields()["num_halves_steps"]


def test_no_halves_when_a_half_costs_as_much_as_the_whole():
    # A small batch: the verify is bound by the weights, so half a batch takes as long as all of it.
    p = _policy()
    plans = simulate(p, 8, 300, verify_s=0.010, chain_s=0.006, work_s={16: 0.030, 8: 0.025, 4: 0.02},
                     hit_rate={16: 0.5, 8: 0.4, 4: 0.3}, halves=(0.0098, 0.0055))
    assert HALVES in plans[:40]  # its ceiling (B a / max(S, c)) beats SD: probed
    assert p.summary() == {8: "sd"} and plans[-100:].count(SD) >= 80
    c = p.costs(8)
    # A halves step measures neither the bucket's verify nor its chain, but H: 9.8 ms for
    # half the batch, 19.6 for all of it. Once measured, H (not the ceiling) predicts halves
    # whenever a probe has discarded its realized rate, so the ceiling does not win it
    # the choice again: only probes run it.
    assert c.verify(False) == pytest.approx(0.010) and c.chain_s == pytest.approx(0.006)
    assert c.halves_s == pytest.approx(0.0196) and model_rate(HALVES, 8, c) == pytest.approx(8 * 3 / 0.0196)
    assert plans[-200:].count(HALVES) <= 12 and p.num_switches <= 1


def test_a_chain_measured_at_fewer_sequences_stands_in_for_c():
    """Batch 4 measures c (8 ms). At batch 32, 2 tokens a sequence per round, a 9 ms verify and a
    plain step of 5.6 ms: SD rounds would make at most 32 x 2 / (9 + 8) ms = 3.8 tokens per ms,
    and a chain over 32 sequences takes no less than over 4; plain steps make 5.7. The bucket
    takes batch 4's c as a floor and runs no SD probe to measure its own; periodic probes still
    run SD (halves left out here: their estimate without half the batch's is model_rate's)."""
    p = _policy(allow_halves=False)
    costs = dict(plain_s=0.0056, tokens=2.0, work_s={16: 0.030, 8: 0.025, 4: 0.02}, hit_rate={16: 0.5, 8: 0.4, 4: 0.3})
    simulate(p, 4, 60, verify_s=0.007, chain_s=0.008, **costs)
    assert p.costs(4).chain_s == pytest.approx(0.008)
    plans = simulate(p, 32, 60, verify_s=0.009, chain_s=0.0095, **costs)
    c = p.costs(32)
    assert SD not in plans and c.chain_s == pytest.approx(0.008) and not c.chain_window  # the floor
    plans += simulate(p, 32, 140, verify_s=0.009, chain_s=0.0095, **costs)
    assert p.summary()[32] == "plain" and plans[-60:].count(PLAIN) >= 50  # SD in periodic probes only


def test_sd_rounds_that_win_at_the_floor_of_c_run_and_measure_it():
    """As above with a 25 ms verify and 3 ms chains (2 ms at batch 4): SD rounds win at the floor
    and run, and the bucket's own c replaces the floor."""
    p = _policy(allow_halves=False)
    costs = dict(tokens=3.0, work_s={16: 0.080, 8: 0.070, 4: 0.06}, hit_rate={16: 0.5, 8: 0.4, 4: 0.3})
    simulate(p, 4, 60, verify_s=0.020, chain_s=0.002, **costs)
    plans = simulate(p, 32, 200, verify_s=0.025, chain_s=0.003, **costs)
    assert p.summary()[32] == "sd" and plans[-100:].count(SD) >= 80
    assert p.costs(32).chain_s == pytest.approx(0.003) and p.costs(32).chain_window


def test_no_halves_where_half_the_batch_measured_costs_as_much_as_the_whole():
    """As above, with batch 4 run first: its verify (9.8 ms) and chain (5.5 ms) put two
    half-batch steps at about 19.6 ms (HALVES_SLACK of it: 16.7), too slow against SD's
    16 ms for batch 8: halves are not run to find that out, only in periodic probes."""
    p = _policy()
    simulate(p, 4, 60, verify_s=0.0098, chain_s=0.0055, work_s={16: 0.030, 8: 0.025, 4: 0.02},
             hit_rate={16: 0.5, 8: 0.4, 4: 0.3})
    assert p.costs(4).verify(False) == pytest.approx(0.0098) and p.costs(4).chain_s == pytest.approx(0.0055)
    plans = simulate(p, 8, 300, verify_s=0.010, chain_s=0.006, work_s={16: 0.030, 8: 0.025, 4: 0.02},
                     hit_rate={16: 0.5, 8: 0.4, 4: 0.3}, halves=(0.0098, 0.0055))
    assert HALVES not in plans[:50] and plans.count(HALVES) <= 12 and p.summary()[8] == "sd"
    assert halves_estimate(p.costs(4)) == pytest.approx(HALVES_SLACK * 2 * 0.0098)
    assert p.costs(8).halves_s == pytest.approx(0.0196)  # measured in the periodic probes: it stands


def test_halves_are_still_found_where_half_the_batch_measured_them_worth_it():
    p = _policy()
    simulate(p, 16, 60, **dict(LONG, verify_s=0.016, chain_s=0.017))
    plans = simulate(p, 32, 300, **LONG, halves=(0.016, 0.017))
    assert p.summary()[32] == "halves" and plans[-100:].count(HALVES) >= 80


def test_a_batch_that_shrinks_keeps_what_the_full_batch_realized():
    """1.5 tokens a sequence per SD round, whose chain waits 2 or 10 ms in turn (the model
    takes the least, 2). At batch 4 plain steps (7.8 ms) realize 513 tok/s against SD's
    at most 473 (over 3 steps), though SD's model says 600. When one sequence finishes and
    3 remain, nothing has run at 3 yet: the model alone rates SD at 450 against plain's
    385; scaled by what each realized against its model at 4, SD is at most 355 and plain
    steps go on."""
    p = _policy(levels=[16], k=4, allow_halves=False)
    hist, plans = [None, None], []

    def run(batch, steps):
        nonlocal hist
        for _ in range(steps):
            plan = p.choose(batch)
            p2, p1 = hist
            if not plan.speculate:
                kw = dict(wait_s=0.0, busy_s=0.0078)
            elif p2 is not None and p2.work_ahead:  # trees overrun the verify: never the best
                kw = dict(wait_s=0.030, busy_s=0.008, num_specs=batch, num_hits=batch, num_drafted=batch,
                          drafted_tokens=round(1.5 * batch), draft_work_s=0.038)
            else:
                kw = dict(wait_s=0.002 if len(plans) % 2 else 0.010, busy_s=0.008, num_specs=batch,
                          num_drafted=batch, drafted_tokens=round(1.5 * batch))
            p.record(batch, plan, **kw)
            plans.append(plan)
            hist = [p1, plan]

    run(4, 200)
    while p._bucket(p.key(4, 0)).probe:  # a probe under way measures SD afresh: let it end
        run(4, 1)
    c = p.costs(4)
    assert p.summary()[4] == "plain" and plans[150:200].count(PLAIN) >= 40
    assert model_rate(SD, 3, c, 4) == pytest.approx(450) and model_rate(PLAIN, 3, c, 4) == pytest.approx(384.6, rel=1e-3)
    realized = c.realized_rate(SD, 4, 4)  # its last steps waited 2, 10, 2 or 10, 2, 10 ms
    assert realized < 0.8 * model_rate(SD, 4, c, 4)
    assert predict(SD, 3, c, 4) == pytest.approx(450 * realized / 600)
    assert predict(SD, 3, c, 4) < predict(PLAIN, 3, c, 4)
    done = len(plans)
    run(3, 60)
    assert plans[done:].count(PLAIN) >= 50


def test_a_filling_batch_runs_plain_steps_until_its_bucket_is_measured():
    """Steps of a batch that is still filling (a sequence in its first rounds) measure nothing
    and would wait for the draft's prefill: plain while the bucket lacks its first
    measurements, then the largest tree once the batch is steady (from batch 4 with backup
    none, below with jit); with plain steps ruled out (--spec-policy always) the largest
    tree at once."""
    p = _policy(k=8)
    assert [p.choose(4, steady=False) for _ in range(3)] == [PLAIN] * 3
    assert p.choose(4) == RoundPlan("ssd", LEVELS[0], "none")
    assert _policy(k=8, allow_plain=False).choose(4, steady=False) == RoundPlan("ssd", LEVELS[0], "none")
    assert [_policy(k=8).choose(b) for b in (1, 2, 3, 16)] == [
        RoundPlan("ssd", LEVELS[0], backup) for backup in ("jit", "jit", "jit", "none")]
    simulate(p, 4, 40, verify_s=0.010, chain_s=0.004, work_s={16: 0.008, 8: 0.006, 4: 0.005},
             hit_rate={16: 0.9, 8: 0.8, 4: 0.7})
    measured = p.costs(4)
    assert measured.chain_s is not None and measured.samples[("w", LEVELS[0])] >= 4
    assert p.choose(4, steady=False).kind == "ssd"  # measured: the best prediction, as when steady


def test_a_draining_batch_keeps_the_choice_of_the_bucket_it_left():
    """Batch 32 at low acceptance: plain steps win. As its requests finish the batch passes
    buckets 16, 8, 4, 2 and 1 in a few steps each, none of them measured: a round there
    would wait for the draft to build its largest tree, for steps too few to pay. The drain
    runs plain steps. A batch size that stands SETTLE_STEPS steps has its bucket measured."""
    p = _policy(k=4)
    simulate(p, 32, 300, verify_s=0.010, chain_s=0.015, work_s={16: 0.030, 8: 0.025, 4: 0.020},
             hit_rate={16: 0.5, 8: 0.4, 4: 0.3}, tokens=1.5, plain_s=0.009)
    assert p.summary() == {32: "plain"}
    drain = [p.choose(b) for b in range(31, 0, -1) for _ in range(3)]
    assert drain == [PLAIN] * len(drain)
    stay = [p.choose(3) for _ in range(SETTLE_STEPS + 1)]  # bucket 2 again, after bucket 1
    assert stay == [PLAIN] * SETTLE_STEPS + [RoundPlan("ssd", LEVELS[0], "jit")]
    # SD rounds and halves pass on too (halves as SD rounds below batch 8); SSD rounds do not.
    q = _policy(k=4, allow_plain=False)
    simulate(q, 16, 300, verify_s=0.010, chain_s=0.006, work_s={16: 0.030, 8: 0.025, 4: 0.020},
             hit_rate={16: 0.5, 8: 0.4, 4: 0.3}, tokens=2.0, halves=(0.006, 0.004))
    assert q.summary() == {16: "halves"}
    assert [q.choose(b) for b in (15, 12, 9, 8, 7, 5, 3)] == [HALVES] * 4 + [SD] * 3  # 8: a bucket of its own


def test_a_drain_switches_to_no_round_in_its_last_steps():
    """SSD rounds win at batch 16, plain steps at 32. As batch 32 drains, bucket 16 runs plain
    steps instead of its SSD choice (the spread its rounds would add costs more than they
    return over the few tokens left). With fewer tokens left than warmup + 3, a step after a
    plain one stays plain: the first rounds after a switch find no tree, and a bucket without
    measurements would measure the largest tree for a step or two; with more left it measures
    it. Where no sequence has two tokens to go a round yields no more than a plain step:
    plain, after rounds too. A measured batch-1 bucket whose choice is SSD keeps it to the
    end once running, but does not switch to it for the last few tokens."""
    p = _policy(k=4)
    simulate(p, 16, 300, verify_s=0.010, chain_s=0.015, work_s={16: 0.011, 8: 0.010, 4: 0.009},
             hit_rate={16: 0.8, 8: 0.7, 4: 0.6}, tokens=2.2, plain_s=0.008)
    simulate(p, 32, 300, verify_s=0.010, chain_s=0.015, work_s={16: 0.030, 8: 0.025, 4: 0.020},
             hit_rate={16: 0.5, 8: 0.4, 4: 0.3}, tokens=1.5, plain_s=0.009)
    assert p.summary() == {16: "ssd 16 branches, backup none", 32: "plain"}
    drain = [p.choose(b, drain=(left, 0.0)) for b, left in [(20, 30), (15, 10), (10, 8), (7, 6), (5, 5), (3, 3),
                                                           (2, 2), (1, 1)]]
    assert drain == [PLAIN] * len(drain)
    assert p.choose(2, drain=(7, 0.0)) == RoundPlan("ssd", LEVELS[0], "jit")  # enough left to measure
    q = _policy(k=4)
    simulate(q, 1, 200, verify_s=0.010, chain_s=0.004, work_s={16: 0.008, 8: 0.007, 4: 0.006},
             hit_rate={16: 0.9, 8: 0.8, 4: 0.7})
    best = RoundPlan("ssd", 16, "jit")
    assert q.summary() == {1: best.label()}
    assert [q.choose(1, drain=(left, 0.0)) for left in (3, 2, 1, 5)] == [best, best, PLAIN, PLAIN]


def test_a_lone_draining_sequence_still_probes():
    """A draining batch starts a periodic probe only with DRAIN_PROBE_LEFT times its wait in
    tokens left: the spread the probe adds, beside its switches. One sequence alone adds no
    spread: its probes need only their wait in tokens left, or a lone request shorter than four
    waits would keep its first choice for good."""
    costs = dict(verify_s=0.005, chain_s=0.006, work_s={16: 0.007, 8: 0.0065, 4: 0.006},
                 hit_rate={16: 0.7, 8: 0.6, 4: 0.5}, tokens=1.6, plain_s=0.0047)
    for batch, probed in ((1, True), (2, False)):
        p = _policy(k=4, probe_every=16)
        simulate(p, batch, 40, **costs)
        assert p.summary() == {batch: "plain"}
        plans = simulate(p, batch, 100, drain=(40, 0.0), **costs)  # 40 tokens left: over 16, under 4 x 16
        assert any(x.speculate for x in plans) == probed


@pytest.mark.parametrize("tokens, faster", [(1.3, "plain"), (3.0, "ssd")])
def test_replay_simulates_a_fresh_policy_on_the_recorded_costs(tmp_path, capsys, tokens, faster):
    """--simulate: a fresh policy run on costs drawn from the records; it finds what the
    recording policy found. At batch 1, plain steps of 14 ms (71 tok/s) against SSD
    rounds of ~21 ms that yield 1.3 tokens (62 tok/s) or 3 (143 tok/s)."""
    replay = _load_replay()
    with _step_records() as lines:
        simulate(_policy(levels=[16, 8], k=4), 1, 400, plain_s=0.014, tokens=tokens, **FITS)
    log = tmp_path / "steps.log"
    log.write_text("\n".join(ln for ln in lines if ln.startswith("step ")) + "\n")
    replay.main([str(log), "--batch", "1", "--levels", "16,8", "--k", "4", "--simulate", "300", "--repeats", "3"])
    out = capsys.readouterr().out
    m = re.search(r"3 simulated runs of 300 steps at batch 1 on 400 records: ([\d.]+) tok/s", out)
    assert m, out
    if faster == "plain":  # the recording policy measured plain steps: the rate stands beside theirs
        alone = re.search(r"plain steps alone ([\d.]+) \(([\d.]+)x\)", out)
        assert float(alone.group(1)) == pytest.approx(1 / 0.014, rel=1e-3) and 0.85 <= float(alone.group(2)) <= 1.0
        # --warm: the counted steps come after the first measurements, so fewer of them speculate.
        replay.main([str(log), "--batch", "1", "--levels", "16,8", "--k", "4", "--simulate", "300", "--repeats", "3",
                     "--warm", "300"])
        warm = capsys.readouterr().out
        assert "300 steps after 300 at batch 1" in warm, warm
        assert float(re.search(r"\(([\d.]+)x\)", warm).group(1)) > float(alone.group(2)), (out, warm)
    else:
        assert "no plain step recorded" in out and float(m.group(1)) > 120, out
    steps = dict(re.findall(r"([a-z][a-z0-9 ,:]*?) ([\d.]+)(?:,|$)", out.splitlines()[-1].split(": ", 1)[1]))
    assert max(steps, key=lambda s: float(steps[s])).startswith(faster), out


def test_replay_stands_in_the_nearest_recorded_plan():
    replay = _load_replay()
    pools = {RoundPlan("ssd", 16, "jit"): {}, RoundPlan("ssd", 4, "none"): {}, PLAIN: {}}
    assert replay._nearest(RoundPlan("ssd", 8, "jit"), pools) == RoundPlan("ssd", 16, "jit")  # the backup first
    assert replay._nearest(RoundPlan("ssd", 8, "jit:1"), pools) == RoundPlan("ssd", 4, "none")
    with pytest.raises(SystemExit, match="no step of a sd plan"):
        replay._nearest(SD, pools)


def test_replay_leaves_a_one_off_stall_out_of_its_draws():
    """A stall (an engine's first SSD step waited 1.36 s on an H200) is paid once
    in a run; drawn at random it would be paid at every draw and sink the simulated rate."""
    replay = _load_replay()
    ssd = RoundPlan("ssd", 15, "jit")
    step = lambda wait_s, busy_s: dict(wait_s=wait_s, busy_s=busy_s, steady=True)  # noqa: E731
    records = [(ssd, 600, step(1.362, 0.052), 1)]
    records += [(ssd, 600, step(0.004 + 0.001 * (i % 5), 0.006), 3) for i in range(40)]
    pools = replay._pools(records)
    drawn = pools[ssd]["steady"] + pools[ssd]["entry"]
    assert len(drawn) == 40 and max(kw["wait_s"] for kw, _ in drawn) < 0.01
    # Within OUTLIER of the median a slow step stays: it is part of the plan's cost.
    pools = replay._pools(records + [(ssd, 600, step(0.030, 0.006), 3)])
    assert len(pools[ssd]["steady"] + pools[ssd]["entry"]) == 41


def _load_replay_all():
    return _load_script("replay_all")


def _write_gz_log(tmp_path, lines):
    """The step records among `lines`, as a gzip log under tmp_path."""
    import gzip

    log = tmp_path / "steps.log.gz"
    log.write_bytes(gzip.compress(("\n".join(ln for ln in lines if ln.startswith("step ")) + "\n").encode()))
    return log


def test_replay_all_simulates_each_recorded_run_beside_its_best_option(tmp_path, capsys):
    """scripts/replay_all.py: gzip step records in; per batch size with enough steady
    records, the simulated policy's rate beside the run's best option (here SSD rounds,
    28 tokens per 20 ms against SD's 12 per 30 ms); too few records: left out."""
    replay_all = _load_replay_all()
    ssd = RoundPlan("ssd", 8, "none")
    with _step_records() as lines:
        p = _policy(levels=[16, 8], k=4)
        for i in range(70):
            plan = PLAIN if i < 15 else SD if i < 40 else ssd
            kw = dict(wait_s=0.0, busy_s=0.006) if plan == PLAIN else dict(
                wait_s=0.010 if plan == SD else 0.002, busy_s=0.020 if plan == SD else 0.018, num_specs=4,
                num_hits=4 * (plan == ssd), num_drafted=4, drafted_tokens=12 if plan == SD else 28,
                draft_work_s=0.015 * (plan == ssd))
            p.record(4, plan, context=600 + i, **kw)
        for _ in range(5):  # batch 2: too few records to simulate
            p.record(2, SD, context=600, wait_s=0.010, busy_s=0.020, num_specs=2, num_drafted=2, drafted_tokens=6)
    log = _write_gz_log(tmp_path, lines)
    replay_all.main([str(log), "--levels", "16,8", "--k", "4", "--repeats", "2", "--steps", "50"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("steps.log.gz batch 4: simulated ")
    m = re.search(r"best option (.+) ([\d.]+) \(([\d.]+)\)$", out[0])
    assert m.group(1) == ssd.label() and float(m.group(2)) == pytest.approx(28 / 0.020)
    assert out[1].startswith("1 runs: simulated / best option ")


def test_replay_all_per_point_replays_each_point_on_its_own_costs(tmp_path, capsys):
    """--per-point: a log of two points at one batch size (bench_e2e's result line after
    each point's records) replays as two runs, each against its own best option (SD in the
    first, SSD in the second); without it, one run over their pool."""
    import gzip

    replay_all = _load_replay_all()
    ssd = RoundPlan("ssd", 8, "none")
    with _step_records() as lines:
        p = _policy(levels=[16, 8], k=4)
        for point in range(2):
            for i in range(70):
                plan = PLAIN if i < 10 else SD if i < 40 else ssd
                fast_ssd = point == 1
                kw = dict(wait_s=0.0, busy_s=0.006) if plan == PLAIN else dict(
                    wait_s=0.010 if plan == SD else 0.002, busy_s=0.020 if plan == SD else 0.018 if fast_ssd else 0.080,
                    num_specs=4, num_hits=4 * (plan == ssd), num_drafted=4, drafted_tokens=12 if plan == SD else 28,
                    draft_work_s=0.015 * (plan == ssd))
                p.record(4, plan, context=600 + i, **kw)
            lines.append(f"[ssd] P={512 * (point + 1)} T=0.0 B=4: 100.0 tok/s")
    records = [ln for ln in lines if ln.startswith("step ") or ln.startswith("[ssd]")]
    log = tmp_path / "points.log.gz"
    log.write_bytes(gzip.compress(("\n".join(records) + "\n").encode()))
    args = [str(log), "--levels", "16,8", "--k", "4", "--repeats", "2", "--steps", "50"]
    replay_all.main(args + ["--per-point"])
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(": simulated")[0] for ln in out[:2]] == [
        "points.log.gz P=512 T=0.0 batch 4", "points.log.gz P=1024 T=0.0 batch 4"]
    assert "best option sd " in out[0] and f"best option {ssd.label()} " in out[1]
    assert out[2].startswith("2 runs: ")
    replay_all.main(args)
    assert capsys.readouterr().out.splitlines()[-1].startswith("1 runs: ")


def test_replay_all_seeded_starts_the_policy_with_the_calibrated_costs(tmp_path, capsys):
    """--seeded: the simulated policy starts with what a calibration at start-up measures,
    taken from the log's steady records (S both ways, P, c, W[n]: medians, c the least SD
    wait), h and a left cold; records of sequences in their first rounds count for nothing."""
    from target_proc.round_model import MIN_SAMPLES

    replay, replay_all = _load_replay(), _load_replay_all()
    big, small = RoundPlan("ssd", 16, "jit"), RoundPlan("ssd", 8, "none")
    with _step_records() as lines:
        p = _policy(levels=[16, 8], k=4)
        spec = dict(num_specs=4, num_drafted=4, drafted_tokens=12)
        for _ in range(3):  # first rounds: far off every steady value
            p.record(4, SD, context=600, wait_s=0.001, busy_s=0.100, steady=False, **spec)
            p.record(4, PLAIN, context=600, wait_s=0.0, busy_s=0.001, steady=False)
        for i in range(15):  # P: 6, 7 or 8 ms, median 7
            p.record(4, PLAIN, context=600 + i, wait_s=0.001, busy_s=0.005 + 0.001 * (i % 3))
        for i in range(25):  # S without a work-ahead: median 20 ms (every fifth 40); c: the least wait, 10 ms
            p.record(4, SD, context=600 + i, wait_s=0.010 + 0.001 * (i % 3), busy_s=0.040 if i % 5 == 4 else 0.020,
                     **spec)
        for i in range(15):
            p.record(4, big, context=600 + i, wait_s=0.003, busy_s=0.018, num_hits=3, draft_work_s=0.025, **spec)
        for i in range(16):  # one without a work-ahead report (left out of W[8]), then 7 of 11 ms and 8 of 13
            work = 0.0 if i == 0 else 0.011 if i <= 7 else 0.013
            p.record(4, small, context=600 + i, wait_s=0.002, busy_s=0.016, num_hits=4, draft_work_s=work, **spec)
    log = _write_gz_log(tmp_path, lines)
    records = replay.read_records(log, 4)
    seeded = _policy(levels=[16, 8], k=4)
    replay.seed_costs(seeded, records, 4, 600, [16, 8, 4])
    c = seeded.costs(4, 600)
    assert c.verify_s == {True: pytest.approx(0.016), False: pytest.approx(0.020)}  # S beside a work-ahead: 31 steps
    assert c.chain_s == pytest.approx(0.010) and c.plain_s == pytest.approx(0.007)
    assert c.work_s == {16: pytest.approx(0.025), 8: pytest.approx(0.013)}
    assert c.samples == Counter({("w", 16): MIN_SAMPLES, ("w", 8): MIN_SAMPLES})
    assert c.hit_rate == {} and c.tokens is None and c.halves_s is None and not c.realized
    assert c.ssd_wait(4, 16, "jit", 4) is None  # h[16] unmeasured
    c.hit_rate[16] = 0.9  # once measured, W[16] counts: its samples stand in for MIN_SAMPLES steps
    assert c.ssd_wait(4, 16, "jit", 4) == pytest.approx(0.025 - 0.016 + (1 - 0.9 ** 4) * 0.010)
    knows = _policy(levels=[16, 8], k=4)  # rates too: a and h[n] as the log's steady rounds realized them
    replay.seed_costs(knows, records, 4, 600, [16, 8, 4], rates=True)
    r = knows.costs(4, 600)
    assert r.tokens == pytest.approx(3.0) and r.hit_rate == {16: pytest.approx(0.75), 8: pytest.approx(1.0)}
    assert sum(h for h, _ in r.hit_window[16]) / sum(n for _, n in r.hit_window[16]) == pytest.approx(0.75)
    assert r.work_s == c.work_s and r.chain_s == c.chain_s
    real, passed = replay_all.simulate, []
    replay_all.simulate = lambda *a, **kw: passed.append(kw["seeded"]) or real(*a, **kw)
    replay_all.main([str(log), "--levels", "16,8", "--k", "4", "--repeats", "2", "--steps", "50", "--seeded"])
    out = capsys.readouterr().out.splitlines()
    assert passed == [True, True], passed
    assert len(out) == 2 and re.match(r"steps\.log\.gz batch 4: simulated [\d.]+ tok/s, best option ", out[0]), out
    assert out[1].startswith("1 runs: simulated / best option "), out


def test_halves_estimate_compares_measured_halves_steps_with_half_the_batchs_costs(tmp_path, capsys):
    """scripts/halves_estimate.py: SD rounds at batch 4 (verify 9 ms, chain 6 ms), then halves
    steps at batch 8 of 10 ms per half: H 20 ms against 2 max(9, 6) = 18 ms."""
    script = _load_script("halves_estimate")
    with _step_records() as lines:
        logged = _policy(k=4)
        for _ in range(8):
            logged.record(4, SD, wait_s=0.006, busy_s=0.009, num_specs=4, num_drafted=4, drafted_tokens=12)
        for _ in range(8):
            logged.record(8, HALVES, wait_s=0.001, busy_s=0.009, num_specs=4, num_drafted=4, drafted_tokens=12,
                          stepped=4)
    log = _write_gz_log(tmp_path, lines)
    [((batch, context), h, lo, hi, n, two)] = script.compare(log)
    assert (batch, context, n) == (8, 1024, 8) and h == lo == hi == pytest.approx(0.020)
    assert two == pytest.approx(0.018)
    script.main([str(log)])
    assert "H / it 1.11" in capsys.readouterr().out
