"""SD against AR on the CPU, on the embedded SmolLM2 pair, and where an SD round's time goes.

One engine per configuration (`ar`, and `sd` at each K, the shipped draft, greedy, chat
template), all loaded first; then `--reps` rounds in which every engine generates the
same `--max-tokens` answer in turn, so a slow spell of a shared machine falls on every
configuration alike. Per configuration, the median over the rounds of: tokens/s, tokens
per step, the target's verify (or decode) time per step and the wait for the draft per
step (from the engine stats). `--cpu-linear torch` runs the projections through F.linear
instead of oneDNN's packed weights, to compare the two.

    python scripts/cpu_sd_split.py --ks 2,4 --reps 5 --out bench/results/cpu_sd_split.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import ExitStack

from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.config import KernelConfig, RuntimeConfig, SpeculativeConfig

PROMPT = "Write a short story about a robot who learns to paint."


def _one(client: Client, ids: list[int], max_tokens: int) -> dict:
    before, t = client.engine_stats(), time.perf_counter()
    out = client.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    wall, after = time.perf_counter() - t, client.engine_stats()
    steps = after.num_steps - before.num_steps
    n = len(out.token_ids)
    return {"tok_s": n / wall, "tokens_per_step": n / steps,
            "verify_ms": 1e3 * (after.verify_s - before.verify_s) / steps,
            "draft_wait_ms": 1e3 * (after.draft_wait_s - before.draft_wait_s) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="2,4", help="comma-separated K values for sd")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cpu-linear", choices=("onednn", "torch"), default="onednn")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    configs = [("ar", 0)] + [("sd", int(k)) for k in args.ks.split(",")]
    runs: dict[str, list[dict]] = {}
    with ExitStack() as stack:
        clients = {}
        for mode, k in configs:
            cfg = RuntimeConfig(spec=SpeculativeConfig(mode=mode, k=k or 4),
                                kernels=KernelConfig(cpu_linear=args.cpu_linear))
            clients[f"{mode}" + (f" K={k}" if k else "")] = stack.enter_context(Client(cfg))
        ids = next(iter(clients.values())).encode_prompt(args.prompt, chat=True)
        for c in clients.values():
            c.generate(ids, SamplingParams(max_tokens=16))  # warm-up
        for rep in range(args.reps):
            for name, c in clients.items():
                runs.setdefault(name, []).append(_one(c, ids, args.max_tokens))
                r = runs[name][-1]
                print(f"rep {rep} {name}: {r['tok_s']:.1f} tok/s, {r['tokens_per_step']:.2f} tok/step, "
                      f"verify {r['verify_ms']:.1f} ms/step, draft wait {r['draft_wait_ms']:.1f} ms/step", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    ar = summary["ar"]["tok_s"]
    print(f"medians over {args.reps} rounds, cpu_linear {args.cpu_linear}, {args.max_tokens} tokens, load "
          f"{os.getloadavg()[0]:.1f}:")
    for name, s in summary.items():
        print(f"  {name}: {s['tok_s']:.1f} tok/s ({s['tok_s'] / ar:.2f}x ar), {s['tokens_per_step']:.2f} tok/step, "
              f"verify {s['verify_ms']:.1f} ms/step, draft wait {s['draft_wait_ms']:.1f} ms/step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"prompt": args.prompt, "max_tokens": args.max_tokens, "reps": args.reps,
                       "cpu_linear": args.cpu_linear, "cpu_count": os.cpu_count(), "runs": runs,
                       "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
