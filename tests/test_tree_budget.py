"""TreeBudget: the SSD tree shrinks when the work-ahead outlasts the verify and grows
back when a larger tree measures to fit; the graph shapes cover every level."""

from __future__ import annotations

import logging

import pytest

from draft_proc.tree_budget import _PAUSE, TreeBudget, bucket_of, ladder, tree_shapes
from spec_runtime.config import SpeculativeConfig


def test_ladder_halves_down_to_a_quarter_and_at_least_one():
    assert ladder(15) == [15, 7, 3]
    assert ladder(16) == [16, 8, 4]
    assert ladder(2) == [2, 1]
    assert ladder(1) == [1]


def test_fixed_never_moves():
    tb = TreeBudget(lambda b: 16, "fixed")
    for _ in range(50):
        tb.observe(1, work_s=0.010, slack_s=0.0)
    assert tb.branches(1) == 16 and tb.num_shrinks == 0


def test_an_overrun_shrinks_one_level_at_once_and_is_logged(caplog):
    tb = TreeBudget(lambda b: 16 // b, "auto")
    with caplog.at_level(logging.INFO, logger="draft_proc.tree_budget"):
        tb.observe(1, work_s=0.012, slack_s=0.0)
    assert tb.branches(1) == 8 and tb.num_shrinks == 1
    assert "16 -> 8 branches per sequence" in caplog.text
    tb.observe(1, work_s=0.009, slack_s=0.0)
    assert tb.branches(1) == 4
    tb.observe(1, work_s=0.007, slack_s=0.0)  # the last level: nowhere to go
    assert tb.branches(1) == 4 and tb.num_shrinks == 2
    # Buckets are separate: batch 3 (bucket 4) still has its full share.
    assert bucket_of(3) == 4 and tb.branches(3) == 4 and tb.branches(4) == 4


def test_grows_back_only_after_a_pause_and_only_when_the_estimate_fits():
    tb = TreeBudget(lambda b: 16, "auto")
    tb.observe(1, work_s=0.012, slack_s=0.0)  # 16 overran at 12 ms
    assert tb.branches(1) == 8
    # A wide window right after the move: no return before the pause.
    for _ in range(_PAUSE - 1):
        tb.observe(1, work_s=0.004, slack_s=0.030)
    assert tb.branches(1) == 8
    tb.observe(1, work_s=0.004, slack_s=0.030)
    assert tb.branches(1) == 16 and tb.num_grows == 1
    # 16 overruns again; now 8 branches take 4 ms in a 10 ms window, and 16 measured
    # 12 ms at best: it never fits, however long 8 runs.
    tb.observe(1, work_s=0.012, slack_s=0.0)
    assert tb.branches(1) == 8
    for _ in range(10 * _PAUSE):
        tb.observe(1, work_s=0.004, slack_s=0.006)
    assert tb.branches(1) == 8 and tb.num_grows == 1


def test_an_unmeasured_level_is_estimated_at_twice_the_work_below():
    tb = TreeBudget(lambda b: 16, "auto")
    tb.observe(1, work_s=0.012, slack_s=0.0)
    tb.observe(1, work_s=0.010, slack_s=0.0)
    assert tb.branches(1) == 4
    # 4 branches: 3 ms in an 8 ms window. 8 branches were measured at 10 ms (too slow);
    # the policy stays.
    for _ in range(3 * _PAUSE):
        tb.observe(1, work_s=0.003, slack_s=0.005)
    assert tb.branches(1) == 4


@pytest.mark.parametrize("shape", ["auto", "fixed"])
def test_tree_graph_shapes_cover_every_level(shape):
    # --tree-budget pins the tree like --tree-shape fixed.
    pins = {} if shape == "auto" else dict(fan_out=(3,) * 5, tree_budget=64)
    spec = SpeculativeConfig(mode="ssd", k=4, tree_shape=shape, **pins)
    shapes = set(tree_shapes(spec, 16))
    for b in (1, 2, 4, 8, 16):
        top = spec.branches_per_seq(b)
        levels = ladder(top) if shape == "auto" else [top]
        for q in levels:
            assert (b, 1 << max(0, (q - 1).bit_length())) in shapes
    if shape == "fixed":
        assert len(shapes) == 5


def test_config_rejects_an_unknown_tree_shape():
    with pytest.raises(ValueError, match="tree_shape"):
        SpeculativeConfig(mode="ssd", tree_shape="big")


def test_default_budget_grows_with_the_batch():
    # 64 branches up to batch 4, then 16 per sequence, at most 256 in all; fan-out 3 at
    # each of 9 depths allows 27 per sequence.
    spec = SpeculativeConfig(mode="ssd", k=8, fan_out=(3,) * 9)
    assert [spec.branches_per_seq(b) for b in (1, 2, 3, 4, 8, 16, 32, 64)] == [27, 27, 16, 16, 16, 16, 8, 4]
    assert spec.tree_levels(16) == [16, 8, 4]
    pinned = SpeculativeConfig(mode="ssd", k=8, fan_out=(3,) * 9, tree_budget=64)
    assert [pinned.branches_per_seq(b) for b in (1, 4, 16, 32)] == [27, 16, 4, 2]
    assert pinned.tree_levels(16) == [4]
    # The tree graphs cover the largest tree step the default allows, 16 x 16.
    assert max(b * q for b, q in tree_shapes(spec, 32)) == 256
