"""Where a draft step's time goes on the GPU: the chain drafter and the SSD work-ahead,
at several context lengths.

    python scripts/profile_draft.py --model random:draft-0.6b --k 8 --fan-out 3 --oracle \
        --contexts 512,8192 --out bench/results/profile_draft.json

Per context length: the chain drafter's propose(), the SSD work-ahead (glue + K tree
steps), and the K tree steps alone, with the shared-prefix layout (one request per
sequence, forward_batch.TreeMask) and with the per-branch layout (one request per
branch, its prefix rows listed in full) for comparison; then the shared-prefix step's
forward alone, replayed back to back (what the GPU takes, without the host's work).
Then torch.profiler's top ops at the last context.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def _timed(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:draft-0.6b")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--fan-out", type=int, default=3, help="branches per depth (F_j for every j)")
    p.add_argument("--tree-budget", type=int, default=64)
    p.add_argument("--contexts", default="512,8192", help="prompt lengths to profile at, comma-separated")
    p.add_argument("--oracle", action="store_true")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--trace", default=None, help="write a chrome trace of work-aheads here (.json.gz)")
    p.add_argument("--top", type=int, default=15, help="rows of the profiler's table of kernels")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    from draft_proc.drafter import ModelDrafter
    from spec_runtime.bench.oracle import draft_oracle
    from draft_proc.ssd import SSDEngine
    from draft_proc.state import DraftSeq
    from draft_proc.tree_budget import scratch_rows_needed, tree_local_rows, tree_shapes
    from spec_runtime.config import ModelConfig, SpeculativeConfig
    from spec_runtime.engine.runner import ModelRunner

    spec = SpeculativeConfig(mode="ssd", k=args.k, fan_out=(args.fan_out,) * (args.k + 1),
                             tree_budget=args.tree_budget,
                             synthetic_acceptance=(0.8, 0.5, 0.2, 0.1) if args.oracle else ())
    slots = max(4, args.batch)
    # Every cycle adds a token: the context grows by about repeats + 16 over a run, and a
    # branch needs 2K + 1 rows past it; a branch cut short by max_model_len would send the
    # tree decode down its per-branch path and time that instead.
    max_len = max(contexts) + args.repeats + 2 * args.k + 48
    runner = ModelRunner.build(ModelConfig(path=args.model, device="cuda:0"), num_slots=slots,
                               max_model_len=max_len, num_scratch_rows=scratch_rows_needed(spec, slots),
                               max_batch_size=max(64, slots), graph_q_lens=(1, 2, args.k + 1),
                               tree_shapes=tree_shapes(spec, slots), tree_local_rows=tree_local_rows(spec))
    drafter = ModelDrafter(runner, spec, logits_transform=draft_oracle(spec.synthetic_acceptance))
    ssd = SSDEngine(drafter, drafter, spec)
    rng = np.random.default_rng(0)
    shared_q_len = ssd.tree_q_len
    results = {"model": args.model, "k": args.k, "batch": args.batch, "fan_out": args.fan_out,
               "tree_budget": args.tree_budget, "oracle": args.oracle, "device": torch.cuda.get_device_name(),
               "contexts": []}

    def cycle(seqs):
        for s in seqs:
            ssd.note_outcome(s, 0, 5)
            s.apply_outcome(0, 5, s.num_tokens + 1, s.round + 1)
        return ssd.propose(seqs, args.k)  # a miss when the cache was cleared: the jit drafter answers

    for ctx in contexts:
        seqs = [DraftSeq(i, i, rng.integers(10, 1000, size=ctx).tolist(), seed=i) for i in range(args.batch)]
        for _ in range(3):
            cycle(seqs)
            ssd.work_ahead(seqs, args.k)

        def chain():
            for s in seqs:
                ssd.cache.clear(s.seq_id)
            cycle(seqs)

        chain_ms = 1e3 * _timed(chain, args.repeats)
        cycle(seqs)
        work_ms = 1e3 * _timed(lambda: ssd.work_ahead(seqs, args.k), args.repeats)
        # The tree steps alone, on the forks of one glue.
        ranked = ssd._glue(seqs)
        forks = ssd._fork(seqs, ranked, ssd._fork_groups(seqs))
        if max(s.num_tokens for s in seqs) + 2 * args.k + 1 > max_len:
            raise SystemExit(f"context {ctx}: the sequences reached max_model_len {max_len}; branches would be cut")
        row = {"context": ctx, "branches": len(forks), "chain_propose_ms": chain_ms, "work_ahead_ms": work_ms}
        for layout, q_len_fn in (("shared_prefix", shared_q_len), ("per_branch", lambda *a: None)):
            ssd.tree_q_len = q_len_fn
            ssd._tree_decode(seqs, forks, args.k)  # warm
            row[f"tree_step_{layout}_ms"] = 1e3 * _timed(lambda: ssd._tree_decode(seqs, forks, args.k),
                                                        args.repeats) / args.k
        ssd.tree_q_len = shared_q_len
        # A tree step's forward alone (its graph replayed back to back: the GPU's time, not the host's).
        batches, forward = [], runner.forward

        def recorded(batch, rows=None):
            batches.append(batch)
            return forward(batch, rows)

        runner.forward = recorded
        ssd._tree_decode(seqs, forks, args.k)
        runner.forward = forward
        row["tree_forward_ms"] = 1e3 * _timed(lambda: forward(batches[0]), args.repeats)
        results["contexts"].append(row)
        print(f"context {ctx}, batch {args.batch}, K={args.k}, {len(forks)} branches: chain propose "
              f"{chain_ms:.2f} ms, work-ahead {work_ms:.2f} ms, tree step {row['tree_step_shared_prefix_ms']:.3f} ms "
              f"shared-prefix / {row['tree_step_per_branch_ms']:.3f} ms per-branch, its forward alone "
              f"{row['tree_forward_ms']:.3f} ms", flush=True)
    if len(results["contexts"]) > 1:
        a, b = results["contexts"][0], results["contexts"][-1]
        ratio = b["tree_step_shared_prefix_ms"] / a["tree_step_shared_prefix_ms"]
        results["tree_step_ratio_last_to_first"] = ratio
        print(f"tree step at context {b['context']} / at {a['context']}: {ratio:.2f}x (shared-prefix), "
              f"{b['tree_step_per_branch_ms'] / a['tree_step_per_branch_ms']:.2f}x (per-branch)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    from torch.profiler import ProfilerActivity, profile

    if args.trace:
        _trace_work_ahead(ssd, seqs, cycle, args.k, args.trace)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            cycle(seqs)
            ssd.work_ahead(seqs, args.k)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    print(avg.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60))


def _labelled(fn, name: str):
    from torch.profiler import record_function

    def run(*a, **kw):
        with record_function(name):
            return fn(*a, **kw)
    return run


def _trace_work_ahead(ssd, seqs, cycle, k: int, path: str, n: int = 5) -> None:
    """A chrome trace of n work-aheads (each after a look-up), the host's phases labelled,
    and the report of scripts/trace_gaps.py on it."""
    import gzip
    import os
    import sys

    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trace_gaps import format_report, gaps_by_label, load

    import draft_proc.tree_layout as layout_module

    for name in ("_glue", "_layout", "_fork", "_tree_decode", "_store"):
        setattr(ssd, name, _labelled(getattr(ssd, name), name.strip("_")))
    ssd.drafter.run_chain = _labelled(ssd.drafter.run_chain, "tree_steps")
    layout_module.tree_arrays = _labelled(layout_module.tree_arrays, "tree_build")
    work = _labelled(ssd.work_ahead, "work_ahead")
    for _ in range(2):
        cycle(seqs)
        work(seqs, k)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            cycle(seqs)
            work(seqs, k)
        torch.cuda.synchronize()
    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    events = load(raw)
    if raw != path:
        with open(raw, "rb") as f, gzip.open(path, "wb") as g:
            g.write(f.read())
        os.remove(raw)
    print(format_report(gaps_by_label(events, "work_ahead"), "work_ahead"), flush=True)


if __name__ == "__main__":
    main()
