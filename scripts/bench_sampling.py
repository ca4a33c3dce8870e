"""Time of the target's rejection sampling at temperature > 0, with the race and the accept
test's uniforms in Triton kernels (spec_runtime.kernels.race) and in torch ops.

Each timed call is what a verify step does after its forward: rejection_sample over
[B, K+1, V] float32 logits, then the result copied to the host (the step's sync). The
median wall time of --iters calls after --warmup, per (B, K) and path.

    python scripts/bench_sampling.py --out bench/results/bench_sampling_<machine>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spec_runtime import rejection, sampling  # noqa: E402
from spec_runtime.sampling import SamplingTensors  # noqa: E402


def time_calls(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--ks", default="0,4")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for b in map(int, args.batches.split(",")):
        st = SamplingTensors.from_params([(args.temperature, 0, 1.0, 1000 + i) for i in range(b)], dev)
        for k in map(int, args.ks.split(",")):
            logits = 4 * torch.randn(b, k + 1, args.vocab, device=dev, generator=g)
            draft = torch.randint(0, args.vocab, (b, k), device=dev, generator=g)
            num_draft = torch.full((b,), k, dtype=torch.int64, device=dev)
            q_ids = torch.randint(0, args.vocab, (b, k, 8), device=dev, generator=g)
            q_probs = torch.softmax(torch.randn(b, k, 8, device=dev, generator=g), -1)
            positions = torch.full((b,), 600, dtype=torch.int64, device=dev)

            def step():
                res = rejection.rejection_sample(logits, draft, num_draft, q_ids, q_probs, st, positions)
                return res.num_accepted.cpu(), res.output_token_ids.cpu()

            fused = time_calls(step, args.warmup, args.iters)
            want = step()
            with mock.patch.object(rejection, "sample", sampling.sample_torch), \
                    mock.patch.object(rejection, "uniform", sampling.uniform_torch):
                torch_ops = time_calls(step, args.warmup, args.iters)
                same = all(torch.equal(a, b_) for a, b_ in zip(want, step()))
            rows.append(dict(batch=b, k=k, kernels_ms=1e3 * fused, torch_ops_ms=1e3 * torch_ops, same_tokens=same))
            print(f"B={b:3d} K={k}: kernels {1e3 * fused:.3f} ms, torch ops {1e3 * torch_ops:.3f} ms, "
                  f"same tokens {same}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                       vocab=args.vocab, temperature=args.temperature, warmup=args.warmup, iters=args.iters,
                       command=" ".join(["scripts/bench_sampling.py"] + sys.argv[1:]), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
