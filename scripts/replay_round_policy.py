"""Replay a run's round-policy step records (`LOG_LEVEL=DEBUG`, lines "step batch B context
C: PLAN, wait W ms, busy X ms, H/N hits, T tokens drafted by D, work-ahead A ms", then the
hits' ranks, ", ranks R R ...", where the draft sent them: each smaller tree's hits) through
target_proc/round_policy.py, and print the rates the policy would give each option at the
batch size of the run, wherever the recorded plan changes. The records come from the
recorded choices, so this shows how the policy rates what ran, not a new run.

    python scripts/replay_round_policy.py bench/results/round_policy_steps_8b_p2048_b16_nvidia-h100-x2_2026-11-26.log \\
        --batch 16 --levels 15,7,3 --k 4

--time also asks the policy for a plan before each record, as the target does every step,
and prints the mean host time of that call (the recorded plan is still the one fed back).

--simulate N runs a fresh policy for N steps at --batch instead, each step costing a record
drawn from those the chosen plan made in the log (the two steps after a change of plan
from that plan's records after a change, as a switch costs; a plan the log never ran from
the recorded plan of its kind nearest in tree shape, which it names; a one-off stall never:
_pools), --repeats times with
seeds 0, 1, ..., and prints the tokens/s it realizes beside plain steps alone: how a change
to the policy would have fared against the costs a GPU run measured. --warm W runs W steps
first and counts only the N after them: a policy that starts with its costs measured.
seed_costs gives a fresh policy the costs a calibration at start-up could measure.

    python scripts/replay_round_policy.py steps.log --batch 1 --levels 15,7,3 --k 4 --simulate 500 --repeats 20
"""

from __future__ import annotations

import argparse
import gzip
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from target_proc.drain import short_jit_len  # noqa: E402
from target_proc.round_model import HITS_WINDOW, MIN_SAMPLES, OUTLIER  # noqa: E402
from target_proc.round_policy import HALVES, PLAIN, SD, SHORT_JIT_DIV, RoundPlan, RoundPolicy, predict  # noqa: E402

STEP = re.compile(r"step batch (\d+) context (\d+): (.*?)( \(first rounds\))?, wait ([\d.]+) ms, busy ([\d.]+) ms, "
                  r"(\d+)/(\d+) hits, (\d+) tokens drafted by (\d+), work-ahead ([\d.]+) ms(?:, ranks ([\d ]+))?")


def parse_plan(label: str) -> tuple[RoundPlan, int, RoundPlan | None]:
    """The plan of a record's label, the sequences it ran when fewer than the batch (0: a
    halves step, or a plain step queued ahead that left out a sequence ending by length),
    and the plan its request named when another (a plain step led into the next), else None."""
    m = re.fullmatch(r"(.*?)(?: \((\d+) run\))?(?: \(requests (.*)\))?", label)
    label, stepped = m.group(1), int(m.group(2) or 0)
    sent = parse_plan(m.group(3))[0] if m.group(3) else None
    if label in ("halves", "sd", "plain"):
        return {"halves": HALVES, "sd": SD, "plain": PLAIN}[label], stepped, sent
    m = re.fullmatch(r"ssd (?:(\d+) branches|configured tree), backup (\S+)", label)  # configured: 0 branches
    if m is None:
        raise ValueError(f"unknown plan {label!r}")
    return RoundPlan("ssd", int(m.group(1) or 0), m.group(2)), stepped, sent


def parse_record(line: str):
    """A step record's (batch, context, label, plan, record's keyword arguments for
    RoundPolicy.record, tokens it yielded), or None for any other line."""
    m = STEP.search(line)
    if m is None:
        return None
    batch, context, label, first, wait, busy, hits, specs, tokens, drafted, work, ranks = m.groups()
    (plan, stepped, sent), batch = parse_plan(label), int(batch)
    kw = dict(wait_s=float(wait) / 1e3, busy_s=float(busy) / 1e3, num_specs=int(specs), num_hits=int(hits),
              num_drafted=int(drafted), drafted_tokens=int(tokens), draft_work_s=float(work) / 1e3,
              steady=first is None, stepped=stepped, sent=sent,
              hit_ranks=[int(r) for r in ranks.split()] if ranks else None)
    ran = stepped or batch
    return batch, int(context), label, plan, kw, ran if not plan.speculate else int(tokens) + ran - int(drafted)


def _log_text(log: Path) -> str:
    """A log's text, plain or gzip (a name ending in .gz)."""
    return gzip.decompress(log.read_bytes()).decode() if log.suffix == ".gz" else log.read_text()


def step_records(log: Path | str):
    """Each step record of the log (plain text, or gzip when it ends in .gz; or the text
    itself, a str), in order (parse_record's tuples)."""
    for line in (log if isinstance(log, str) else _log_text(log)).splitlines():
        if (record := parse_record(line)) is not None:
            yield record


POINT = re.compile(r"^\[(?:ssd|sd|ar)\] P=(\d+) T=([\d.]+) B=(\d+)( alpha=[\d.]+)?:")


def point_logs(log: Path) -> list[tuple[str, int, str]]:
    """The log cut at each point's result line (scripts/gpu_ssd.sh keeps bench_e2e's
    "[ssd] P=512 T=0.0 B=16: ..." lines among the records): (label, the point's batch
    size, the text of its records, warm-ups included), one per point. A log of several
    points at one batch size (prompt lengths, temperatures) then replays each on its own
    costs instead of their pool."""
    points, lines = [], []
    for line in _log_text(log).splitlines():
        if (m := POINT.match(line)) is not None:
            points.append((f"P={m.group(1)} T={m.group(2)}{m.group(4) or ''}", int(m.group(3)), "\n".join(lines)))
            lines = []
        elif STEP.search(line):
            lines.append(line)
    return points


def read_records(log: Path | str, batch: int) -> list[tuple[RoundPlan, int, dict, float]]:
    """(plan, context, record's keyword arguments for RoundPolicy.record, tokens it yielded)
    of each step record of `batch` sequences, in order (log: as step_records')."""
    return [(plan, context, kw, tokens) for b, context, _, plan, kw, tokens in step_records(log) if b == batch]


def seed_costs(policy: RoundPolicy, records, batch: int, context: int, levels: list[int],
               rates: bool = False) -> None:
    """Fill `policy`'s costs of (`batch`, `context`) from the steady records of `batch`: the
    best case of a calibration at start-up, which measures the target's verify S (beside a
    work-ahead and without), a plain step's time P, the chain wait c and the draft's
    work-ahead W[n] at each tree shape n, but not the hit rates h[n] or the tokens per
    round a (those depend on the requests' text). S, P and W[n] are medians, c the least
    wait of the SD steps; what the log never ran stays unmeasured. rates: h[n] and a too,
    as the log's rounds realized them (a's window from its last full-length rounds): a
    policy that knows every rate before it runs an option, which no start-up can give."""
    steady = [(plan, kw) for plan, _, kw, _ in records if kw["steady"]]
    ssd = [kw for plan, kw in steady if plan.kind == "ssd"]
    sd = [kw for plan, kw in steady if plan.kind == "sd"]
    plain = [kw for plan, kw in steady if plan.kind == "plain"]
    c = policy.costs(batch, context)
    if ssd:
        c.verify_s[True] = statistics.median(kw["busy_s"] for kw in ssd)
    if sd:
        c.verify_s[False] = statistics.median(kw["busy_s"] for kw in sd)
        c.chain_s = min(kw["wait_s"] for kw in sd)
    if plain:
        c.plain_s = statistics.median(kw["busy_s"] + kw["wait_s"] for kw in plain)
    for n in levels:
        work = [kw["draft_work_s"] for plan, kw in steady
                if plan.kind == "ssd" and plan.branches == n and kw["draft_work_s"] > 0]
        if work:
            c.work_s[n] = statistics.median(work)
            c.samples[("w", n)] = MIN_SAMPLES
    if not rates:
        return
    for plan, kw in steady:
        if kw["num_drafted"] and not short_jit_len(plan.backup):  # full-length speculations, as record counts them
            c.add_tokens(kw["drafted_tokens"], kw["num_drafted"])
    for n in levels:
        looked = [(kw["num_hits"], kw["num_specs"]) for plan, kw in steady
                  if plan.kind == "ssd" and plan.branches == n and kw["num_specs"]]
        for h, s in looked[-HITS_WINDOW:]:  # the long-run window of look-ups, as the rounds would fill it
            c.add_hits(n, h, s)
        if looked:
            c.hit_rate[n] = sum(h for h, _ in looked) / sum(s for _, s in looked)


def simulate(records, batch: int, levels: list[int], k: int, steps: int, seed: int,
             warm: int = 0, seeded: bool = False, seed_rates: bool = False) -> tuple[float, Counter, dict]:
    """A fresh RoundPolicy run for `warm` + `steps` steps on costs drawn from `records` (the
    module doc): (tokens/s of the last `steps`, their steps per plan label, {plan the log
    lacks: the plan that stood in}). seeded: the policy starts with seed_costs's costs
    (seed_rates: and its rates)."""
    pools = _pools(records)
    context = int(statistics.median(c for _, c, _, _ in records))
    policy = RoundPolicy(lambda b: levels, k=k, short_jit=k // SHORT_JIT_DIV)
    if seeded or seed_rates:
        seed_costs(policy, records, batch, context, levels, rates=seed_rates)
    rng, stand_in = random.Random(seed), {}
    before, seconds, total, ran = [None, None], 0.0, 0.0, Counter()
    for step in range(warm + steps):
        plan = policy.choose(batch, context)
        pool = pools.get(plan) or pools.get(stand_in.setdefault(plan, _nearest(plan, pools)))
        drawn = pool["steady" if before == [plan, plan] else "entry"] or pool["steady"] or pool["entry"]
        kw, tokens = rng.choice(drawn)
        policy.record(batch, plan, context=context, **{**kw, "sent": None})  # the drawn plan's own flags
        before = [before[1], plan]
        if step >= warm:
            seconds, total = seconds + kw["wait_s"] + kw["busy_s"], total + tokens
            ran[plan.label()] += 1
    return total / seconds, ran, stand_in


def _pools(records) -> dict:
    """{plan: {"steady": [(kw, tokens)], "entry": [...]}} of the steady records: "steady" the
    steps whose two before ran the same plan, "entry" the rest (a switch's cost). A stall,
    a step more than OUTLIER times its plan's median step time (an engine's first SSD step
    waited 1.36 s on an H200, against about 12 ms), is left out: the run paid it once, and
    drawn at random it would be paid again at every draw."""
    steady, before = [], [None, None]
    for plan, _, kw, tokens in records:
        if kw["steady"]:
            steady.append((plan, "steady" if before == [plan, plan] else "entry", kw, tokens))
        before = [before[1], plan]
    times: dict = {}
    for plan, _, kw, _ in steady:
        times.setdefault(plan, []).append(kw["wait_s"] + kw["busy_s"])
    median = {plan: statistics.median(t) for plan, t in times.items()}
    pools: dict = {}
    for plan, kind, kw, tokens in steady:
        pool = pools.setdefault(plan, {"steady": [], "entry": []})
        if kw["wait_s"] + kw["busy_s"] <= OUTLIER * median[plan]:
            pool[kind].append((kw, tokens))
    return pools


def _nearest(plan: RoundPlan, pools: dict) -> RoundPlan:
    """The recorded plan of `plan`'s kind nearest in tree shape (the same backup first)."""
    same = [p for p in pools if p.kind == plan.kind]
    if not same:
        raise SystemExit(f"the log has no step of a {plan.kind} plan ({plan.label()}) at this batch size")
    return min(same, key=lambda p: (p.backup != plan.backup, abs(p.branches - plan.branches)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--batch", type=int, required=True, help="the batch size whose choices are printed")
    p.add_argument("--levels", required=True, help="the tree shapes of that batch size, largest first")
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--top", type=int, default=4)
    p.add_argument("--time", action="store_true", help="time RoundPolicy.choose before each record")
    p.add_argument("--simulate", type=int, default=0, help="steps of a fresh policy on the recorded costs")
    p.add_argument("--repeats", type=int, default=10, help="simulated runs (seeds 0, 1, ...)")
    p.add_argument("--warm", type=int, default=0, help="simulated steps before the counted ones")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    if args.simulate:
        _print_simulation(args, levels)
        return
    policy = RoundPolicy(lambda b: levels, k=args.k, short_jit=args.k // SHORT_JIT_DIV)
    last = None
    choose_s, chosen = 0.0, 0
    for batch, context, label, plan, kw, _ in step_records(Path(args.log)):
        if batch == args.batch and plan != last:
            c = policy.costs(batch, context)
            rates = {o.label(): predict(o, batch, c, args.k) for o in policy.options(batch)}
            ranked = sorted(((r, o) for o, r in rates.items() if r is not None), reverse=True)[: args.top]
            print(f"context {context}, runs {label}: " + ", ".join(f"{o} {r:.0f}" for r, o in ranked))
            last = plan
        if args.time:
            t0 = time.perf_counter()
            policy.choose(batch, context)
            choose_s += time.perf_counter() - t0
            chosen += 1
        policy.record(batch, plan, context=context, **kw)
    if chosen:
        print(f"RoundPolicy.choose: {1e6 * choose_s / chosen:.1f} us per step over {chosen} steps")


def _print_simulation(args, levels: list[int]) -> None:
    records = read_records(Path(args.log), args.batch)
    if not any(kw["steady"] for _, _, kw, _ in records):
        raise SystemExit(f"{args.log}: no step record of batch {args.batch} past its sequences' first rounds")
    plain = [(kw, t) for plan, _, kw, t in records if plan == PLAIN and kw["steady"]]
    alone = sum(t for _, t in plain) / sum(kw["wait_s"] + kw["busy_s"] for kw, _ in plain) if plain else None
    runs = [simulate(records, args.batch, levels, args.k, args.simulate, seed, args.warm)
            for seed in range(args.repeats)]
    rates = [r for r, _, _ in runs]
    for plan, stood in sorted({p: s for _, _, m in runs for p, s in m.items()}.items(), key=lambda x: x[0].label()):
        print(f"{plan.label()} never ran in the log: costs of {stood.label()} stand in")
    ran = sum((r for _, r, _ in runs), Counter())
    mean = statistics.mean(rates)
    warm = f" after {args.warm}" if args.warm else ""
    print(f"{len(runs)} simulated runs of {args.simulate} steps{warm} at batch {args.batch} on {len(records)} records: "
          f"{mean:.1f} tok/s (min {min(rates):.1f}, max {max(rates):.1f}); "
          + (f"plain steps alone {alone:.1f} ({mean / alone:.3f}x)" if alone else "no plain step recorded"))
    print("steps per run: " + ", ".join(f"{label} {n / len(runs):.1f}" for label, n in ran.most_common()))


if __name__ == "__main__":
    main()
