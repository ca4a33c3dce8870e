"""The round policy on a batch that drains, simulated on the costs of recorded runs: B sequences
that each decode --tokens tokens, no request waiting, as scripts/bench_e2e.py runs a point. A
fresh policy chooses every step, told the batch's drain (target_proc/drain.py) or not (--blind
beside it); each step costs a record drawn from those its plan made in the log (as
scripts/replay_round_policy.py's simulation draws them), scaled to the sequences still running
by the log's plain steps at each batch size (linear between the recorded sizes); each running
sequence advances by 1 token on a plain step, and on a speculating one (with the share of the
record's sequences that had drafts) by 1 + J, J drawn from a chain of K tokens at the per-token
acceptance of the record's tokens per drafted sequence. The run ends when the last sequence
does: tokens/s is B x tokens over that time (after --warmups such runs of 32 tokens with the same
policy, as bench_e2e.py warms each point), beside plain steps alone (tokens steps of the
batch's median plain step).

    cd bench/results && python ../../scripts/replay_drain.py round_policy_steps_8b_*alpha06*.log.gz \\
        --levels 15,7,3 --k 4 --tokens 512 --repeats 10
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay_all import MIN_STEADY  # noqa: E402
from replay_round_policy import _nearest, _pools, point_logs, read_records, step_records  # noqa: E402
from target_proc.drain import acceptance, batch_drain  # noqa: E402
from target_proc.round_policy import SHORT_JIT_DIV, RoundPolicy  # noqa: E402


def plain_step_times(text: str) -> dict[int, float]:
    """{batch size: median time of its steady plain steps} over every batch size of a log's text."""
    times: dict[int, list[float]] = {}
    for batch, _, _, plan, kw, _ in step_records(text):
        if plan.kind == "plain" and kw["steady"]:
            times.setdefault(batch, []).append(kw["wait_s"] + kw["busy_s"])
    return {b: statistics.median(t) for b, t in times.items()}


def scale(plain: dict[int, float], batch: int, n: int) -> float:
    """A step of n sequences against one of `batch`, from plain steps' times (linear between recorded sizes)."""
    sizes = sorted(plain)
    if batch not in plain or len(sizes) < 2:
        return 1.0
    lo = max([b for b in sizes if b <= n], default=sizes[0])
    hi = min([b for b in sizes if b >= n], default=sizes[-1])
    t = plain[lo] if hi == lo else plain[lo] + (plain[hi] - plain[lo]) * (n - lo) / (hi - lo)
    return t / plain[batch]


def _advance(plan, kw: dict, batch: int, k: int) -> tuple[list[float], float]:
    """Cumulative probabilities of J = 0..k for a drafted sequence, and the chance a sequence is drafted."""
    if not plan.speculate or not kw["num_drafted"]:
        return [], 0.0
    x = acceptance(kw["drafted_tokens"] / kw["num_drafted"], k)
    pmf = [x ** j * (1 - x) for j in range(k)] + [x ** k]
    cum, total = [], 0.0
    for p in pmf:
        total += p
        cum.append(total)
    return cum, kw["num_drafted"] / batch


def run(records, plain: dict[int, float], batch: int, levels: list[int], k: int, tokens: int, seed: int,
        told: bool, warmups: int = 0, warmup_tokens: int = 32) -> tuple[float, Counter]:
    """One drained batch (module doc) after `warmups` of `warmup_tokens` each, one policy throughout:
    (tokens/s of the last, its steps per plan label)."""
    pools = _pools(records)
    context = int(statistics.median(c for _, c, _, _ in records))
    policy = RoundPolicy(lambda b: levels, k=k, short_jit=k // SHORT_JIT_DIV)
    for n in range(1, batch + 1):  # only the plans the log ran: a stand-in's steps would not be its own
        policy._options[n] = [o for o in policy.options(n) if o in pools]
    rng = random.Random(seed)
    for length in [warmup_tokens] * warmups + [tokens]:
        rate, ran = _drain(policy, pools, plain, rng, batch, context, k, length, told)
    return rate, ran


def _drain(policy, pools, plain, rng, batch, context, k, tokens, told) -> tuple[float, Counter]:
    remaining, seconds, before, ran = [tokens] * batch, 0.0, [None, None], Counter()
    while remaining and sum(ran.values()) < 20 * tokens:
        n = len(remaining)
        plan = policy.choose(n, context, drain=batch_drain(remaining, 0) if told else None)
        pool = pools.get(plan) or pools[_nearest(plan, pools)]  # a first measurement the log lacks (SD's c)
        drawn = pool["steady" if before == [plan, plan] else "entry"] or pool["steady"] or pool["entry"]
        kw, _ = rng.choice(drawn)
        step_s = (kw["wait_s"] + kw["busy_s"]) * scale(plain, batch, n)
        f = n / batch  # the record's counts for the sequences still running
        counts = {key: round(kw[key] * f) for key in ("num_specs", "num_hits", "num_drafted", "drafted_tokens")}
        policy.record(n, plan, context=context, **{**kw, **counts, "stepped": round(kw["stepped"] * f),
                                                    "busy_s": kw["busy_s"] * step_s / (kw["wait_s"] + kw["busy_s"]),
                                                    "wait_s": kw["wait_s"] * step_s / (kw["wait_s"] + kw["busy_s"]),
                                                    "sent": None, "hit_ranks": None})
        cum, drafted = _advance(plan, kw, batch, k)
        stepping = (kw["stepped"] or batch) / batch
        for i in range(n):
            if plan.kind == "halves" and rng.random() >= stepping:
                continue
            j = 0
            if cum and rng.random() < drafted / stepping:
                u = rng.random()
                j = next((m for m, c in enumerate(cum) if u <= c), k)
            remaining[i] -= 1 + j
        remaining = [r for r in remaining if r > 0]
        seconds += step_s
        before = [before[1], plan]
        ran[plan.label()] += 1
    return batch * tokens / seconds, ran


def _plain_share(runs) -> float:
    steps = sum((c for _, c in runs), Counter())
    return steps["plain"] / sum(steps.values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--batches", default="2,4,8,16,32")
    p.add_argument("--levels", required=True, help="the tree shapes, largest first (every batch size)")
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--tokens", type=int, default=512, help="tokens each sequence decodes")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmups", type=int, default=2, help="drained batches of 32 tokens before the timed one")
    args = p.parse_args(argv)
    levels, batches = [int(x) for x in args.levels.split(",")], set(map(int, args.batches.split(",")))
    told_all, blind_all = [], []
    for log in args.logs:
        for label, batch, text in point_logs(Path(log)):
            records = read_records(text, batch)
            plain = plain_step_times(text)
            if batch not in batches or batch not in plain or sum(r[2]["steady"] for r in records) < MIN_STEADY:
                continue
            alone = batch / plain[batch]
            try:
                told, blind = ([run(records, plain, batch, levels, args.k, args.tokens, s, told, args.warmups)
                                for s in range(args.repeats)] for told in (True, False))
            except SystemExit as e:  # a first measurement the log lacks, of a kind it never ran
                print(f"{Path(log).name} {label} batch {batch}: not simulated ({e})")
                continue
            t, b = statistics.mean(r for r, _ in told), statistics.mean(r for r, _ in blind)
            told_all.append(t / alone)
            blind_all.append(b / alone)
            share = [_plain_share(runs) for runs in (told, blind)]
            print(f"{Path(log).name} {label} batch {batch}: told {t:.1f}, blind {b:.1f} tok/s ({t / b:.3f}x), "
                  f"plain alone {alone:.1f} (told {t / alone:.3f}x, blind {b / alone:.3f}x; plain steps "
                  f"{share[0]:.0%} and {share[1]:.0%})")
    if told_all:
        print(f"{len(told_all)} points: against plain steps alone, told {statistics.mean(told_all):.4f} "
              f"(min {min(told_all):.3f}), blind {statistics.mean(blind_all):.4f} (min {min(blind_all):.3f})")


if __name__ == "__main__":
    main()
