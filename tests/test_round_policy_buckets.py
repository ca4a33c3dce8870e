"""The SSD round policy across buckets and probes: a batch size nothing has run at starts
from its nearest neighbour's costs, and a probe that comes close to the choice runs until
its realized rate rests on a full window. Costs are injected (tests/test_round_policy.py's
simulated draft and target)."""

from __future__ import annotations

import logging
from itertools import groupby

from target_proc.round_model import WINDOW
from target_proc.round_policy import SD
from tests.test_round_policy import _policy, simulate

SLOW_TREES = dict(verify_s=0.0108, chain_s=0.0106, work_s={16: 0.034, 8: 0.030}, hit_rate={16: 0.8, 8: 0.75},
                  tokens=3.33)


def _runs(plans):
    return [(plan, len(list(g))) for plan, g in groupby(plans)]


def test_a_batch_size_nothing_has_run_at_starts_from_its_neighbours_costs(caplog):
    """Batch 16 settles on SD (the trees overrun the verify). When sequences finish and 8
    remain, a bucket nothing has run at, it starts from batch 16's costs and choice: SD
    from its first step to its first periodic probe, where it would otherwise run the
    largest tree until measured and then probe SD."""
    p = _policy(levels=[16, 8], k=4, allow_halves=False)
    simulate(p, 16, 200, **SLOW_TREES)
    assert p.summary() == {16: "sd"}
    with caplog.at_level(logging.INFO, logger="target_proc.round_policy"):
        plans = simulate(p, 8, 40, **SLOW_TREES)
    assert plans[:31] == [SD] * 31  # probe_every 32
    assert "batch size ~8, context up to 1024 tokens: starts from the costs of batch size ~16" in caplog.text
    fresh = _policy(levels=[16, 8], k=4, allow_halves=False)
    assert simulate(fresh, 8, 40, **SLOW_TREES)[0].kind == "ssd"  # with nothing to start from: the largest tree


def test_a_seeded_bucket_is_rated_by_the_model_at_its_own_batch_size():
    """The same draft and target at batch 16 and 2. At 16 nearly every SSD round has a miss
    (0.8^16) and waits for the jit chain: SD wins. At 2 most rounds hit every sequence
    (0.8^2): from batch 16's costs the model already rates SSD ahead there, so batch 2
    runs SSD from its first step, and its own steps then keep it there."""
    p = _policy(levels=[16, 8], k=4, allow_halves=False, backup_auto=False)
    costs = dict(SLOW_TREES, work_s={16: 0.012, 8: 0.011})
    simulate(p, 16, 200, **costs)
    assert p.summary() == {16: "sd"}
    plans = simulate(p, 2, 200, **costs)
    assert plans[0].kind == "ssd"
    assert sum(pl.kind == "ssd" for pl in plans) >= 180
    assert p.summary()[2].startswith("ssd")


def test_a_close_probe_runs_until_its_window_is_full():
    """SD leads SSD by about 5%. A periodic probe of SSD that loses by so little runs on
    until its realized rate rests on a full window (WINDOW steps after the first three of
    the switch) before the choice stands; a probe of plain decoding, 40% behind, does not."""
    p = _policy(levels=[16, 8], k=4, allow_halves=False, backup_auto=False)
    # SSD 16: 4a / (S + (W - S) + (1 - 0.9^4) c) = 4a / 22.5 ms; SD: 4a / 21.4 ms.
    costs = dict(SLOW_TREES, work_s={16: 0.0188, 8: 0.025}, hit_rate={16: 0.9, 8: 0.85})
    plans = simulate(p, 4, 600, **costs)
    assert p.summary() == {4: "sd"}
    probes = [(plan, n) for plan, n in _runs(plans[100:]) if plan != SD]
    ssd = [n for plan, n in probes if plan.kind == "ssd"]
    assert ssd and all(n == WINDOW + 3 for n in ssd), probes
    assert all(n == 6 for plan, n in probes if plan.kind == "plain"), probes
