"""Replay a run's round-policy step records (`LOG_LEVEL=DEBUG`, lines "step batch B context
C: PLAN, wait W ms, busy X ms, H/N hits, T tokens drafted by D, work-ahead A ms") through
target_proc/round_policy.py, and print the rates the policy would give each option at the
batch size of the run, wherever the recorded plan changes. The records come from the
recorded choices, so this shows how the policy rates what ran, not a new run.

    python scripts/replay_round_policy.py bench/results/round_policy_steps_8b_p2048_b16_nvidia-h100-x2_2026-11-26.log \\
        --batch 16 --levels 15,7,3 --k 4

--time also asks the policy for a plan before each record, as the target does every step,
and prints the mean host time of that call (the recorded plan is still the one fed back).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from target_proc.round_policy import HALVES, PLAIN, SD, SHORT_JIT_DIV, RoundPlan, RoundPolicy, predict  # noqa: E402

STEP = re.compile(r"step batch (\d+) context (\d+): (.*?)( \(first rounds\))?, wait ([\d.]+) ms, busy ([\d.]+) ms, "
                  r"(\d+)/(\d+) hits, (\d+) tokens drafted by (\d+), work-ahead ([\d.]+) ms")


def parse_plan(label: str) -> tuple[RoundPlan, int]:
    """The plan of a record's label, and the sequences it ran when fewer than the batch (0):
    a halves step, or a plain step queued ahead that left out a sequence ending by length."""
    m = re.fullmatch(r"(.*?)(?: \((\d+) run\))?", label)
    label, stepped = m.group(1), int(m.group(2) or 0)
    if label in ("halves", "sd", "plain"):
        return {"halves": HALVES, "sd": SD, "plain": PLAIN}[label], stepped
    m = re.fullmatch(r"ssd (\d+) branches, backup (\S+)", label)
    if m is None:
        raise ValueError(f"unknown plan {label!r}")
    return RoundPlan("ssd", int(m.group(1)), m.group(2)), stepped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--batch", type=int, required=True, help="the batch size whose choices are printed")
    p.add_argument("--levels", required=True, help="the tree shapes of that batch size, largest first")
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--top", type=int, default=4)
    p.add_argument("--time", action="store_true", help="time RoundPolicy.choose before each record")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    policy = RoundPolicy(lambda b: levels, k=args.k, short_jit=args.k // SHORT_JIT_DIV)
    last, context = None, 0
    choose_s, chosen = 0.0, 0
    for line in Path(args.log).read_text().splitlines():
        m = STEP.search(line)
        if m is None:
            continue
        batch, context, label, first, wait, busy, hits, specs, tokens, drafted, work = m.groups()
        (plan, stepped), batch, context = parse_plan(label), int(batch), int(context)
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
        policy.record(batch, plan, context=context, wait_s=float(wait) / 1e3, busy_s=float(busy) / 1e3,
                      num_specs=int(specs), num_hits=int(hits), num_drafted=int(drafted),
                      drafted_tokens=int(tokens), draft_work_s=float(work) / 1e3, steady=first is None,
                      stepped=stepped)
    if chosen:
        print(f"RoundPolicy.choose: {1e6 * choose_s / chosen:.1f} us per step over {chosen} steps")


if __name__ == "__main__":
    main()
