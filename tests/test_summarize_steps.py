"""scripts/summarize_steps.py: where each point's step time went, from step records."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "summarize_steps.py"


def _module():
    spec = importlib.util.spec_from_file_location("summarize_steps", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _step(batch, plan, wait, busy, tokens, drafted, first=False):
    return (f"(target pid=1) DEBUG target_proc.round_policy: step batch {batch} context 600: {plan}"
            f"{' (first rounds)' if first else ''}, wait {wait:.2f} ms, busy {busy:.2f} ms, 0/{drafted} hits, "
            f"{tokens} tokens drafted by {drafted}, work-ahead 0.00 ms")


def test_a_points_steps_split_into_its_best_plan_the_rest_and_other_batch_sizes(tmp_path, capsys):
    lines = [_step(4, "sd", 30, 30, 4, 4, first=True)]  # a first round: left out
    lines += [_step(4, "sd", 10, 10, 12, 4)] * 14  # 12 tokens / 20 ms: 600 tok/s
    lines += [_step(4, "plain", 0, 10, 0, 0)] * 2  # 4 tokens / 10 ms: 3.3 ms more than SD's rate
    lines[-1] = _step(4, "plain (requests sd)", 0, 10, 0, 0)  # a plain step all the same
    lines += [_step(2, "sd", 10, 10, 6, 2), "[ssd] P=512 T=0.0 B=4: 500.0 tok/s (decode 510.0)"]
    # A halves step runs 2 of the 4 sequences: 6 tokens (its 2, 3 each) in 10 ms.
    lines += [_step(4, "halves (2 run)", 0.5, 9.5, 6, 2)] * 13
    # The engine's line: the timed run's last 12 steps (600 tok/s by their records) decoded 540 tok/s.
    lines += ["[ssd] P=512 T=0.0 B=4: 530.0 tok/s (decode 540.0, steps 541.0), 3.00 tok/round, admit=0.10 ms, "
              "steps 12, ssd/sd rounds 0/0, halves steps 12, plain steps 0"]
    log = tmp_path / "steps.log.gz"
    with gzip.open(log, "wt") as f:
        f.write("\n".join(["unrelated line", *lines]) + "\n")
    mod = _module()
    (_, first, none), (_, second, engine) = mod.read(str(log))
    assert none is None and engine == (540.0, 12)
    r = mod.summarize(first)
    assert r["total_s"] == pytest.approx(0.32) and r["other_batch"] == pytest.approx(0.02 / 0.32)
    assert r["best"] == "sd" and r["plans"] == {"sd": (14, pytest.approx(600)), "plain": (2, None)}
    assert r["loss"] == pytest.approx(2 * (0.010 - 4 / 600) / 0.32)
    assert r["switch_loss"] == pytest.approx(r["loss"])  # both plain steps follow the change
    h = mod.summarize(second, timed=12)
    assert h["best"] == "halves" and h["plans"]["halves"][1] == pytest.approx(600) and h["loss"] == pytest.approx(0)
    assert h["records_rate"] == pytest.approx(600)
    mod.main([str(log)])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("prompt 512, T 0.0, batch 4: 0.32 s of steps, 6% at other batch sizes")
    assert out[1].endswith("; the timed run's 12 records 600.0 tok/s, the engine's decode 540.0 (0.900x)")


def test_ssd_rounds_hit_rates_are_those_of_their_steady_steps(tmp_path, capsys):
    """Per SSD plan, hits over look-ups in the steps three or more after a change of plan."""
    def ssd(hits):
        return (f"(target pid=1) DEBUG target_proc.round_policy: step batch 4 context 600: ssd 7 branches, backup none, "
                f"wait 1.00 ms, busy 9.00 ms, {hits}/4 hits, {3 * hits} tokens drafted by {hits}, work-ahead 8.00 ms")
    lines = [ssd(0)] * 3 + [ssd(3)] * 8 + [ssd(2)] * 4 + ["[ssd] P=512 T=0.0 B=4: 500.0 tok/s (decode 510.0)"]
    log = tmp_path / "steps.log"
    log.write_text("\n".join(lines) + "\n")
    mod = _module()
    ((_, steps, _),) = mod.read(str(log))
    assert mod.summarize(steps)["hit_rates"] == {"ssd 7 branches, backup none": pytest.approx(32 / 48)}
    mod.main([str(log)])
    assert "ssd 7 branches, backup none 15 steps 933 tok/s hit 0.67" in capsys.readouterr().out


def test_the_hits_ranks_give_each_smaller_trees_hit_rate(tmp_path, capsys):
    """Records that name their hits' ranks: the 15-branch tree's look-ups rate the 7- and
    3-branch trees of its ladder (a tree of n holds ranks below n)."""
    def ssd(ranks):
        tail = f", ranks {' '.join(map(str, ranks))}" if ranks else ""
        return (f"step batch 4 context 600: ssd 15 branches, backup none, wait 1.00 ms, busy 9.00 ms, "
                f"{len(ranks)}/4 hits, {3 * len(ranks)} tokens drafted by {len(ranks)}, work-ahead 8.00 ms{tail}")
    lines = [ssd([0, 2, 5, 9])] * 8 + [ssd([])] * 4 + ["[ssd] P=512 T=0.0 B=4: 500.0 tok/s (decode 510.0)"]
    log = tmp_path / "steps.log"
    log.write_text("\n".join(lines) + "\n")
    mod = _module()
    ((_, steps, _),) = mod.read(str(log))
    r = mod.summarize(steps)
    # Steps 3-11 count: 5 with 4 hits (ranks 0 2 5 9), 4 with none, 36 look-ups.
    assert r["hit_rates"] == {"ssd 15 branches, backup none": pytest.approx(20 / 36)}
    assert r["smaller_hit_rates"] == {"ssd 15 branches, backup none": {7: pytest.approx(15 / 36),
                                                                       3: pytest.approx(10 / 36)}}
    mod.main([str(log)])
    assert "hit 0.56 (7: 0.42, 3: 0.28)" in capsys.readouterr().out
    # A hit whose rank the record does not name: no smaller trees' rates.
    steps[5].ranks = None
    assert mod.summarize(steps)["smaller_hit_rates"] == {}


def test_a_pinned_trees_records_are_read():
    """A tree pinned by --tree-budget or --fan-out is labelled "ssd configured tree" (RoundPlan
    with 0 branches): its records parse, and the label of its plan reads back the same."""
    _module()  # puts the repository on the path, as the script does
    from scripts.replay_round_policy import parse_plan

    (plan, stepped, sent) = parse_plan("ssd configured tree, backup jit:1")
    assert (plan.kind, plan.branches, plan.backup, stepped, sent) == ("ssd", 0, "jit:1", 0, None)
    assert plan.label() == "ssd configured tree, backup jit:1"


def test_the_timed_runs_loss_is_broken_down_by_plan(tmp_path, capsys):
    """--timed: the timed run's records (the last `steps N`) against the point's best plan, per
    plan, with the first three steps after a change and the steps at a smaller batch apart."""
    lines = [_step(4, "sd", 10, 10, 12, 4)] * 14  # 600 tok/s, the best plan
    lines += [_step(4, "plain", 0, 10, 0, 0)] * 2 + [_step(2, "sd", 10, 10, 6, 2)]
    lines += ["[ssd] P=512 T=0.0 B=4: 500.0 tok/s (decode 510.0, steps 511.0), steps 3, "]
    log = tmp_path / "steps.log"
    log.write_text("\n".join(lines) + "\n")
    mod = _module()
    ((_, steps, engine),) = mod.read(str(log))
    total, losses = mod.timed_losses(steps, engine[1], 600.0)
    assert total == pytest.approx(0.040)
    assert losses == {"plain, switch": (2, pytest.approx(2 * (0.010 - 4 / 600))),
                      "sd, switch, smaller batch": (1, pytest.approx(0.020 - 6 / 600))}
    mod.main([str(log), "--timed"])
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["  timed run, sd, switch, smaller batch: 1 steps, +10.0 ms (+25.0%)",
                       "  timed run, plain, switch: 2 steps, +6.7 ms (+16.7%)"]
