"""Host time of an SSD work-ahead's bookkeeping on the CPU, without the model's steps: the
forks (SSDEngine._fork over one glue's ranking) and the tree decode with its K steps
left out (the tree step's inputs laid out, the branches stored; drafter.run_chain
replaced by one that builds the first step's batch and returns zeros).

    python scripts/bench_work_ahead_host.py --batch 16 --branches 112

A tiny random Llama (scripts/tiny_models.py), K=4, fan-out 3 per depth, --context tokens
per sequence, every outcome (0, 5). Prints the medians over --repeats work-aheads (ms).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--branches", type=int, default=112, help="the tree budget")
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from tiny_models import save_tiny_model

    from draft_proc.drafter import ModelDrafter
    from draft_proc.ssd import SSDEngine
    from draft_proc.state import DraftSeq
    from draft_proc.tree_budget import scratch_rows_needed
    from spec_runtime.config import ModelConfig, SpeculativeConfig
    from spec_runtime.engine.runner import ModelRunner

    path = save_tiny_model(Path(tempfile.mkdtemp()) / "m", "llama")
    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(3,) * (K + 1), tree_budget=args.branches)
    runner = ModelRunner(ModelConfig(path=path), num_slots=args.batch, max_model_len=args.context + 100,
                         num_scratch_rows=scratch_rows_needed(spec, args.batch))
    drafter = ModelDrafter(runner, spec)
    ssd = SSDEngine(drafter, drafter, spec)
    rng = np.random.default_rng(0)
    seqs = [DraftSeq(i, i, rng.integers(10, 300, size=args.context).tolist(), seed=i) for i in range(args.batch)]
    for _ in range(2):
        for s in seqs:
            ssd.note_outcome(s, 0, 5)
            s.apply_outcome(0, 5, s.num_tokens + 1, s.round + 1)
        ssd.propose(seqs, K)
        ssd.work_ahead(seqs, K)
    ranked = ssd._glue(seqs)

    def no_steps(make_batch, rows, positions, k, select=None):
        make_batch(0, None)
        return np.zeros((len(rows), k), dtype=np.int64), None, None

    drafter.run_chain = no_steps
    fork, tree = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        forks = ssd._fork(seqs, ranked, ssd._fork_groups(seqs))
        t1 = time.perf_counter()
        ssd._tree_decode(seqs, forks, K)
        tree.append(1e3 * (time.perf_counter() - t1))
        fork.append(1e3 * (t1 - t0))
    result = {"batch": args.batch, "branches": len(forks), "context": args.context,
              "fork_ms": float(np.median(fork)), "tree_host_ms": float(np.median(tree))}
    print(f"batch {args.batch}, {len(forks)} branches: fork {result['fork_ms']:.3f} ms, tree decode without its "
          f"steps {result['tree_host_ms']:.3f} ms (medians of {args.repeats})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
