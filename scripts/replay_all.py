"""This tree's round policy, simulated on the costs of every recorded run: for each log of
step records (`LOG_LEVEL=DEBUG`, plain or .gz) and batch size with at least MIN_STEADY
records past their sequences' first rounds, scripts/replay_round_policy.py's simulation (a
fresh policy, --steps steps, --repeats seeds) beside the best single option of that log,
as it realized there (scripts/summarize_steps.py's rate of a plan: its steps three or more
after a change of plan, at least ten of them). The ratio says how much of the best fixed
choice a cold policy gets in a run of that length; run it from two trees to compare
policies. --seeded starts each simulated policy with S, P, c and W[n] taken from the log, as
a calibration at start-up would measure them (h and a cold). --per-point replays each point
of a log (a prompt length and temperature at a batch size, between bench_e2e's result
lines) on its own costs, where a log of several points at one batch size would pool them.
--seeded-rates seeds the hit rates and tokens per round as well: the share of a cold
run's loss that knowing every rate up front would take away.

    python scripts/replay_all.py bench/results/round_policy_steps_*alpha08*.log.gz --levels 15,7,3 --k 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay_round_policy import point_logs, read_records, simulate  # noqa: E402
from summarize_steps import Step, plan_rates  # noqa: E402

MIN_STEADY = 60  # steady records of a batch size before it is simulated


def best_option(records) -> tuple[float, str] | None:
    """The option of `records` whose steady steps realized the most tokens/s, and its rate,
    as scripts/summarize_steps.py rates a plan (its steps three or more after a change)."""
    steps = [Step(0, plan.label(), tokens, kw["wait_s"] + kw["busy_s"]) for plan, _, kw, tokens in records
             if kw["steady"]]
    rates, _ = plan_rates(steps)
    return max((rate, label) for label, rate in rates.items()) if rates else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--levels", required=True, help="the tree shapes, largest first (every batch size)")
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--steps", type=int, default=170, help="simulated steps per run (512 tokens at ~3 per round)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warm", type=int, default=0, help="simulated steps before the counted ones (a warm policy)")
    p.add_argument("--seeded", action="store_true",
                   help="the policy starts with S, P, c and W[n] taken from the log, as a calibration at start-up "
                        "would measure them; h and a cold")
    p.add_argument("--seeded-rates", action="store_true",
                   help="--seeded, and the hit rates and tokens per round too, as the log's rounds realized them: "
                        "a policy that knows every rate before it runs an option (no start-up can measure them)")
    p.add_argument("--per-point", action="store_true",
                   help="replay each point of a log (its records up to a bench_e2e result line) on its own")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    ratios = []
    batches = set(map(int, args.batches.split(",")))
    for log in args.logs:
        for name, batch, source in _runs(Path(log), batches, args.per_point):
            records = read_records(source, batch)
            best = best_option(records)
            if sum(1 for r in records if r[2]["steady"]) < MIN_STEADY or best is None:
                continue
            try:
                rates = [simulate(records, batch, levels, args.k, args.steps, seed, args.warm, seeded=args.seeded,
                                  seed_rates=args.seeded_rates)[0] for seed in range(args.repeats)]
            except SystemExit as e:  # an option the log never ran and nothing stands in for
                print(f"{name} batch {batch}: not simulated ({e})")
                continue
            mean = statistics.mean(rates)
            ratios.append(mean / best[0])
            print(f"{name} batch {batch}: simulated {mean:.1f} tok/s, best option {best[1]} {best[0]:.1f} "
                  f"({mean / best[0]:.3f})")
    if ratios:
        print(f"{len(ratios)} runs: simulated / best option {statistics.mean(ratios):.4f} on average "
              f"(min {min(ratios):.3f})")


def _runs(log: Path, batches: set[int], per_point: bool):
    """(name, batch size, records' source for read_records) of each run a log holds: one per
    batch size, or with per_point one per point whose batch size is in `batches`."""
    if not per_point:
        return [(log.name, b, log) for b in sorted(batches)]
    return [(f"{log.name} {label}", b, text) for label, b, text in point_logs(log) if b in batches]


if __name__ == "__main__":
    main()
