"""The round policy's estimate of an unmeasured halves step against the halves steps a run
measured, from its step records (`LOG_LEVEL=DEBUG bash scripts/gpu_ssd.sh`).

    python scripts/halves_estimate.py bench/results/round_policy_steps_8b_p8192_b1_32_alpha06_greedy_e439faa_nvidia-h200-x2_2026-11-28.log.gz

Feeds each log's records to a RoundPolicy, as the target does. For every bucket (batch
size, context) whose halves steps it measured, prints H (a halves step scaled to the whole
batch: the median of its last 8, the fastest and the slowest of all) beside two max(S', c')
of the bucket of half the batch (its verify and chain at the end of the log), which
round_model.halves_estimate scales by HALVES_SLACK, and the ratio of H to it.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.replay_round_policy import step_records  # noqa: E402
from target_proc.round_model import HALVES_SLACK, halves_estimate  # noqa: E402
from target_proc.round_policy import HALVES, RoundPolicy  # noqa: E402


def compare(log: Path) -> list[tuple[tuple[int, int], float, float, float, int, float | None]]:
    """(bucket, H, fastest, slowest, halves steps, 2 max(S', c') or None) per bucket with H."""
    policy = RoundPolicy(lambda b: [0], k=4)
    samples, where = defaultdict(list), {}
    for batch, context, _, plan, kw, _ in step_records(log):
        policy.record(batch, plan, context=context, **kw)
        key = policy.key(batch, context)
        if plan == HALVES and kw["steady"] and kw["stepped"]:
            samples[key].append(batch / kw["stepped"] * (kw["wait_s"] + kw["busy_s"]))
            where[key] = (batch, context)
    rows = []
    for key, (batch, context) in sorted(where.items()):
        h = policy.costs(batch, context).halves_s
        if h is None:
            continue
        est = halves_estimate(policy.costs((batch + 1) // 2, context))
        rows.append((key, h, min(samples[key]), max(samples[key]), len(samples[key]),
                     None if est is None else est / HALVES_SLACK))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    args = p.parse_args(argv)
    for log in args.logs:
        print(Path(log).name)
        for (batch, context), h, lo, hi, n, two in compare(Path(log)):
            est = f"2 max(S', c') {1e3 * two:.2f} ms, H / it {h / two:.2f} ({lo / two:.2f}-{hi / two:.2f})" if two \
                else "half the batch's S or c unmeasured"
            print(f"  batch ~{batch}, context up to {context}: H {1e3 * h:.2f} ms ({1e3 * lo:.2f}-{1e3 * hi:.2f}, "
                  f"{n} steps); {est}")


if __name__ == "__main__":
    main()
