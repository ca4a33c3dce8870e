"""Where a draft step's time goes on the GPU: the chain drafter and the SSD work-ahead.

    python scripts/profile_draft.py --model random:draft-0.6b --k 8 --fan-out 3 --oracle

Prints wall time per propose() / work_ahead(), the split between building the batch,
the forward, and sampling, and torch.profiler's top CPU ops.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:draft-0.6b")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--fan-out", type=int, default=3, help="branches per depth (F_j for every j)")
    p.add_argument("--oracle", action="store_true")
    args = p.parse_args()

    from draft_proc.drafter import ModelDrafter
    from draft_proc.factory import make_oracle_transform
    from draft_proc.ssd import SSDEngine, scratch_rows_needed
    from draft_proc.state import DraftSeq
    from spec_runtime.config import ModelConfig, SpeculativeConfig
    from spec_runtime.model import forward_batch as fb
    from spec_runtime.model.runner import ModelRunner

    spec = SpeculativeConfig(mode="ssd", k=args.k, fan_out=(args.fan_out,) * (args.k + 1),
                             synthetic_acceptance=0.8 if args.oracle else None,
                             synthetic_ranks=(0.5, 0.2, 0.1) if args.oracle else ())
    runner = ModelRunner(ModelConfig(path=args.model, device="cuda:0"), num_slots=max(4, args.batch),
                         max_model_len=1024, num_scratch_rows=scratch_rows_needed(spec, max(4, args.batch)),
                         max_batch_size=64, graph_q_lens=(1, 2, args.k + 1))
    drafter = ModelDrafter(runner, spec, logits_transform=make_oracle_transform(spec))
    ssd = SSDEngine(drafter, drafter, spec)
    rng = np.random.default_rng(0)

    def fresh():
        return [DraftSeq(i, i, rng.integers(10, 1000, size=128).tolist(), seed=i) for i in range(args.batch)]

    # Instrument the three phases of a step.
    t = {"build": 0.0, "forward": 0.0, "sample": 0.0}
    orig_build, orig_forward, orig_sample = fb.build_forward_batch, runner.forward, drafter.sample

    def timed(name, fn):
        def wrap(*a, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            torch.cuda.synchronize()
            t[name] += time.perf_counter() - t0
            return out
        return wrap

    import spec_runtime.model.runner as runner_mod
    runner_mod.build_forward_batch = timed("build", orig_build)
    runner.forward = timed("forward", orig_forward)
    drafter.sample = timed("sample", orig_sample)

    def cycle(seqs):
        for s in seqs:
            ssd.note_outcome(s, 0, 5)
            s.apply_outcome(0, 5, s.num_tokens + 1, s.round + 1)
        prop, _, _ = ssd.propose(seqs, args.k)  # first round: a miss, the jit drafter answers
        return prop

    seqs = fresh()
    for _ in range(3):
        cycle(seqs)
        ssd.work_ahead(seqs, args.k)
    for key in t:
        t[key] = 0.0
    n = 10
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        for s in seqs:
            ssd.cache.clear(s.seq_id)
        cycle(seqs)
    torch.cuda.synchronize()
    chain = (time.perf_counter() - t0) / n
    print(f"chain propose (K={args.k}, batch {args.batch}): {1e3 * chain:.2f} ms/round; per phase per round: "
          + ", ".join(f"{k} {1e3 * v / n:.2f} ms" for k, v in t.items()))
    for key in t:
        t[key] = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        ssd.work_ahead(seqs, args.k)
    torch.cuda.synchronize()
    work = (time.perf_counter() - t0) / n
    print(f"SSD work-ahead (glue + {args.k} tree steps, {ssd.num_entries()} branches): {1e3 * work:.2f} ms/round; "
          + ", ".join(f"{k} {1e3 * v / n:.2f} ms" for k, v in t.items()))

    # Un-instrumented, then the profiler.
    runner_mod.build_forward_batch, runner.forward, drafter.sample = orig_build, orig_forward, orig_sample
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        cycle(seqs)
    torch.cuda.synchronize()
    print(f"chain propose, no instrumentation: {1e3 * (time.perf_counter() - t0) / n:.2f} ms/round")
    t0 = time.perf_counter()
    for _ in range(n):
        ssd.work_ahead(seqs, args.k)
    torch.cuda.synchronize()
    print(f"SSD work-ahead, no instrumentation: {1e3 * (time.perf_counter() - t0) / n:.2f} ms/round")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            cycle(seqs)
            ssd.work_ahead(seqs, args.k)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    print(avg.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    print(avg.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
