"""Where each point's step time went, from a run's round-policy step records
(`LOG_LEVEL=DEBUG bash scripts/gpu_ssd.sh` writes them, with the line that ends each
point, to $OUT/steps_$TAG.log; plain or gzipped).

    python scripts/summarize_steps.py bench/results/round_policy_steps_8b_halves_from4_nvidia-h100-x2_2026-11-26.log.gz

Per point (the records up to its "[ssd] P=... B=..." line):
  - other batch sizes: the share of step time at batch sizes below the point's, while its
    batch filled up and emptied;
  - per plan at the point's batch size: steps, and tokens/s over the steps three or more
    after a change of plan (its own tokens over its own time; at least MIN_STEADY of them),
    and for SSD rounds the share of look-ups that hit the tree over those steps; where the
    records name the hits' ranks, also the share that a tree of each smaller shape of the
    ladder would have hit (it holds the forks of rank below its size);
  - the loss: step time at the point's batch size beyond what its best plan would have
    taken for the same tokens, as a share of all step time (probes, switches and choices
    other than the best), and the part of it in the first three steps after each change
    of plan;
  - with --timed, the timed run's records alone: their time beyond what the point's best plan
    would have taken for the same tokens, per plan, split into the first three steps after
    each change and steps at a smaller batch size (the batch filling up and emptying);
  - the timed run's records (the last `steps N` of the point's line) against the engine:
    their tokens over their time beside its decode tok/s. The records time each step from
    the landing before it, so the two differ by the time before the first step and after
    the last (0.4% at most in docs/benchmarks.md's runs); a larger gap is time no record holds.
Steps of a sequence's first rounds are left out of the rest, as the policy leaves them out.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.replay_round_policy import parse_record  # noqa: E402
from spec_runtime.config import tree_ladder  # noqa: E402

POINT = re.compile(r"^\[ssd\] P=(\d+) T=([\d.]+) B=(\d+)( alpha=[\d.]+)?:(?:.*?decode ([\d.]+))?(?:.*? steps (\d+), )?")
MIN_STEADY = 10  # steady steps before a plan's rate is shown


@dataclass
class Step:
    batch: int
    plan: str  # the record's label
    tokens: int
    seconds: float
    steady: bool = True  # past the first rounds of its sequences
    hits: int = 0  # look-ups that hit the tree cache, of
    looked_up: int = 0
    ranks: list[int] | None = None  # the hits' ranks, where the record names them


def read(path: str) -> list[tuple[str, list[Step], tuple[float, int] | None]]:
    """(point, its steps, (the engine's decode tok/s, steps of the timed run) or None) for
    each point of the file, in order."""
    opener = gzip.open if path.endswith(".gz") else open
    points, steps = [], []
    with opener(path, "rt") as f:
        for line in f:
            record = parse_record(line)
            if record is not None:
                batch, _, _, plan, kw, tokens = record
                steps.append(Step(batch, plan.label(), tokens, kw["wait_s"] + kw["busy_s"], kw["steady"],
                                  kw["num_hits"], kw["num_specs"] if plan.work_ahead else 0, kw["hit_ranks"]))
                continue
            p = POINT.match(line)
            if p is not None:
                engine = (float(p.group(5)), int(p.group(6))) if p.group(5) and p.group(6) else None
                points.append((f"prompt {p.group(1)}, T {p.group(2)}, batch {p.group(3)}{p.group(4) or ''}", steps,
                               engine))
                steps = []
    return points


def plan_rates(steps: list[Step]) -> tuple[dict[str, float], list[int]]:
    """Per plan, tokens/s over its steps three or more after a change of plan (at least
    MIN_STEADY of them), and for each step the steps since the last change."""
    since, last, n = [], None, 0
    for s in steps:
        n = n + 1 if s.plan == last else 0
        last = s.plan
        since.append(n)
    sums = defaultdict(lambda: [0, 0.0, 0])
    for s, k in zip(steps, since):
        if k >= 3:
            sums[s.plan][0] += s.tokens
            sums[s.plan][1] += s.seconds
            sums[s.plan][2] += 1
    return {p: t / sec for p, (t, sec, count) in sums.items() if count >= MIN_STEADY}, since


def _looked_up(steps: list[Step], since: list[int]) -> dict[str, list[Step]]:
    """Per SSD plan, its steps three or more after a change of plan (those plan_rates counts;
    the first look-ups after a change find the previous tree)."""
    counted = defaultdict(list)
    for s, k in zip(steps, since):
        if k >= 3 and s.looked_up:
            counted[s.plan].append(s)
    return counted


def hit_rates(steps: list[Step], since: list[int]) -> dict[str, float]:
    """Per SSD plan, hits over look-ups in its counted steps (_looked_up)."""
    return {p: sum(s.hits for s in g) / sum(s.looked_up for s in g) for p, g in _looked_up(steps, since).items()}


def smaller_hit_rates(steps: list[Step], since: list[int]) -> dict[str, dict[int, float]]:
    """Per SSD plan whose counted steps (_looked_up) all name their hits' ranks: for each
    smaller shape n of its ladder (tree_ladder), the share of look-ups with a hit of rank < n."""
    out = {}
    for plan, group in _looked_up(steps, since).items():
        m = re.match(r"ssd (\d+) branches", plan)
        if m is None or any(s.hits and s.ranks is None for s in group):
            continue
        looked_up = sum(s.looked_up for s in group)
        out[plan] = {n: sum(r < n for s in group for r in s.ranks or ()) / looked_up
                     for n in tree_ladder(int(m.group(1)))[1:]}
    return out


def summarize(steps: list[Step], timed: int = 0) -> dict:
    """The measures of the module doc for one point's steps (its steady ones; the last
    `timed` of them all: the records of the timed run)."""
    timed = steps[-timed:] if timed else []
    steps = [s for s in steps if s.steady]
    total = sum(s.seconds for s in steps)
    batch = max(s.batch for s in steps)
    full = [s for s in steps if s.batch == batch]
    rates, since = plan_rates(full)
    counts = Counter(s.plan for s in full)
    out = dict(batch=batch, total_s=total, other_batch=(total - sum(s.seconds for s in full)) / total,
               plans={p: (n, rates.get(p)) for p, n in counts.most_common()}, hit_rates=hit_rates(full, since),
               smaller_hit_rates=smaller_hit_rates(full, since))
    if timed:
        out["records_rate"] = sum(s.tokens for s in timed) / sum(s.seconds for s in timed)
    if rates:
        best = max(rates, key=rates.get)
        extra = [s.seconds - s.tokens / rates[best] for s in full]
        out.update(best=best, loss=sum(extra) / total,
                   switch_loss=sum(e for e, k in zip(extra, since) if k < 3) / total)
    return out


def timed_losses(steps: list[Step], timed: int, rate: float) -> tuple[float, dict[str, tuple[int, float]]]:
    """The last `timed` steps' time, and per plan (", switch": one of the first three steps after a
    change; ", smaller batch": below the point's batch size) their steps and their time beyond
    `rate` (tokens/s) for the same tokens."""
    steps = steps[-timed:]
    batch, out = max(s.batch for s in steps), defaultdict(lambda: [0, 0.0])
    for s, n in zip(steps, plan_rates(steps)[1]):
        label = s.plan + (", switch" if n < 3 else "") + (", smaller batch" if s.batch < batch else "")
        out[label][0] += 1
        out[label][1] += s.seconds - s.tokens / rate
    return sum(s.seconds for s in steps), {k: (c, sec) for k, (c, sec) in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--timed", action="store_true", help="break the timed run's loss down by plan")
    args = p.parse_args(argv)
    for point, steps, engine in read(args.log):
        if not any(s.steady for s in steps):
            continue
        r = summarize(steps, engine[1] if engine else 0)
        hits, smaller = r["hit_rates"], r["smaller_hit_rates"]
        plans = ", ".join(f"{label} {n} steps" + (f" {rate:.0f} tok/s" if rate else "")
                          + (f" hit {hits[label]:.2f}" if label in hits else "")
                          + (" (" + ", ".join(f"{k}: {v:.2f}" for k, v in smaller[label].items()) + ")"
                             if smaller.get(label) else "") for label, (n, rate) in r["plans"].items())
        loss = (f"loss against {r['best']}: {100 * r['loss']:.1f}% ({100 * r['switch_loss']:.1f}% in the first "
                f"three steps after a change)" if "best" in r else "no plan with enough steady steps")
        timed = (f"; the timed run's {engine[1]} records {r['records_rate']:.1f} tok/s, the engine's decode "
                 f"{engine[0]:.1f} ({engine[0] / r['records_rate']:.3f}x)" if engine else "")
        print(f"{point}: {r['total_s']:.2f} s of steps, {100 * r['other_batch']:.0f}% at other batch sizes; {loss}; "
              f"{plans}{timed}")
        if args.timed and engine and "best" in r:
            total, losses = timed_losses(steps, engine[1], r["plans"][r["best"]][1])
            for label, (n, extra) in sorted(losses.items(), key=lambda kv: -kv[1][1]):
                print(f"  timed run, {label}: {n} steps, {1e3 * extra:+.1f} ms ({100 * extra / total:+.1f}%)")


if __name__ == "__main__":
    main()
