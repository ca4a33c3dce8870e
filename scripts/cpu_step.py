"""The CPU forward of one sequence at 1 to 9 new tokens, with the projections through
oneDNN's packed weights (`--cpu-linear onednn`, the default) and through F.linear.

Decode is 1 token, a verify of K drafts K + 1. Both runners load the same model (the
embedded SmolLM2-135M-Instruct unless `--model` names another); the timed forwards
alternate between them so a slow spell of a shared machine falls on both. Also reports
whether each setting's logits of a token depend on how many tokens share its forward
(the last token of an n-token forward against the same token fed alone after the
others' KV).

    python scripts/cpu_step.py --out bench/results/cpu_step_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from spec_runtime.config import KernelConfig, ModelConfig
from spec_runtime.engine.forward_batch import ForwardItem
from spec_runtime.engine.runner import ModelRunner

SETTINGS = ("onednn", "torch")


def _item(start: int, n: int) -> ForwardItem:
    ids = [(7 * (start + i)) % 1000 + 100 for i in range(n)]
    return ForwardItem(token_ids=ids, start_pos=start, kv_rows=np.arange(start + n, dtype=np.int64), logits="all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV before the timed forward")
    ap.add_argument("--q-lens", default="1,2,3,5,9")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    q_lens = [int(q) for q in args.q_lens.split(",")]
    runners = {s: ModelRunner.build(ModelConfig(path=args.model), kernels=KernelConfig(cpu_linear=s), num_slots=1,
                                    max_model_len=args.context + max(q_lens) + 1) for s in SETTINGS}
    for r in runners.values():
        r.run([_item(0, args.context)])
    times: dict[str, dict[int, list[float]]] = {s: {q: [] for q in q_lens} for s in SETTINGS}
    for rep in range(args.reps + 2):
        for q in q_lens:
            for s, r in runners.items():
                t = time.perf_counter()
                r.run([_item(args.context, q)]).argmax(-1)
                if rep >= 2:  # two warm-up rounds
                    times[s][q].append(time.perf_counter() - t)
    invariant = {}
    for s, r in runners.items():
        n = max(q_lens)
        whole = r.run([_item(args.context, n)])[-1]
        r.run([ForwardItem(token_ids=_item(args.context, n).token_ids[:-1], start_pos=args.context,
                           kv_rows=np.arange(args.context + n - 1, dtype=np.int64), logits="none")])
        alone = r.run([_item(args.context + n - 1, 1)])[-1]
        invariant[s] = bool(torch.equal(whole, alone))
    median = {s: {q: 1e3 * statistics.median(ts) for q, ts in per.items()} for s, per in times.items()}
    print(f"{runners['onednn'].model_name}, context {args.context}, median of {args.reps} forwards (ms), "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print("new tokens  " + "  ".join(f"{q:>6}" for q in q_lens))
    for s in SETTINGS:
        print(f"{s:<10}  " + "  ".join(f"{median[s][q]:6.1f}" for q in q_lens)
              + f"   last token's logits independent of the batch: {invariant[s]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": runners["onednn"].model_name, "context": args.context, "reps": args.reps,
                       "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                       "median_ms": median, "batch_invariant_last_token": invariant,
                       "times_s": times}, f, indent=1)


if __name__ == "__main__":
    main()
