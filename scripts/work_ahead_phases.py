"""Where an SSD work-ahead's time goes, without a profiler: each phase timed on the host
(perf_counter at entry and exit) and on the GPU (a CUDA event recorded at the same
points), so the host time that leaves the GPU idle shows as such.

    python scripts/work_ahead_phases.py BATCH BRANCHES CONTEXT [nooracle] [--timeline] [--layouts early,late]
        [--forks device,host]
    python scripts/work_ahead_phases.py --configs 1:15:512:nooracle,16:112:512:oracle [...]

draft-1b, K=4, fan-out 3 per depth, BRANCHES the tree budget (per work-ahead), CONTEXT
tokens of random prompt per sequence, the synthetic oracle unless `nooracle`, one CUDA
device, one intra-op thread (as the draft process runs). Prints, over 15 work-aheads
after five untimed ones, the median host time of each phase:
  - glue prep: the glue's entry to its forward's (items, page table, upload);
  - glue after forward: the forward's return to the glue's (oracle, ranking);
  - layout: the first tree step laid out while the glue's forward runs (tree_layout.py);
  - fork (on the host: the ranking read back, a sync; on the device: the choice's
    launches), tree prep (the tree decode's entry to its steps'), steps, store;
  - work-ahead: the whole, and forwards GPU: the five forwards' GPU time (entry to exit
    event of each, the GPU's own time where it was busy before the entry).
With --timeline, the last work-ahead's marks: host and GPU ms since the start; where the
GPU's time equals the host's, the GPU waited for the host. --layouts and --forks: every
pair in turn, twice each, in one process. Layouts: `early` as SSDEngine does it, `late`
with the step laid out only once the forks are chosen (the layout made before the forks
is dropped). Forks: chosen on the `device` as SSDEngine does on a GPU (fork_device.py),
or on the `host` after reading the ranking back (tree_cache.py; a late layout always
chooses there).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

K = 4
SPANS = (("glue prep", "glue>", "fwd>"), ("glue after forward", "fwd<", "glue<"), ("layout", "layout>", "layout<"),
         ("fork", "fork>", "fork<"),
         ("tree prep", "tree_decode>", "steps>"), ("steps", "steps>", "steps<"), ("store", "store>", "store<"))


def build(batch: int, budget: int, ctx: int, oracle: bool):
    from draft_proc.drafter import ModelDrafter
    from draft_proc.ssd import SSDEngine
    from draft_proc.state import DraftSeq
    from draft_proc.tree_budget import scratch_rows_needed, tree_local_rows, tree_shapes
    from spec_runtime.bench.oracle import draft_oracle
    from spec_runtime.config import ModelConfig, SpeculativeConfig
    from spec_runtime.engine.runner import ModelRunner

    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(3,) * (K + 1), tree_budget=budget,
                             synthetic_acceptance=(0.8, 0.5, 0.2, 0.1) if oracle else ())
    slots = max(4, batch)
    runner = ModelRunner.build(ModelConfig(path="random:draft-1b", device="cuda:0"), num_slots=slots,
                               max_model_len=ctx + 200, num_scratch_rows=scratch_rows_needed(spec, slots),
                               max_batch_size=max(64, slots), graph_q_lens=(1, 2, K + 1),
                               tree_shapes=tree_shapes(spec, slots), tree_local_rows=tree_local_rows(spec))
    drafter = ModelDrafter(runner, spec, logits_transform=draft_oracle(spec.synthetic_acceptance))
    rng = np.random.default_rng(0)
    seqs = [DraftSeq(i, i, rng.integers(10, 1000, size=ctx).tolist(), seed=i) for i in range(batch)]
    return runner, drafter, SSDEngine(drafter, drafter, spec), seqs


def instrument(ssd, drafter, runner, marks: list):
    """Record (name, host time, CUDA event) into `marks` at the entry (">") and exit ("<")
    of each phase; returns the recorder, mark(name)."""

    def mark(name: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((name, time.perf_counter(), e))

    def wrap(obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def run(*a, **kw):
            mark(name + ">")
            out = fn(*a, **kw)
            mark(name + "<")
            return out
        setattr(obj, attr, run)

    for attr in ("_glue", "_layout", "_fork", "_tree_decode", "_store"):
        wrap(ssd, attr, attr.strip("_"))
    wrap(drafter, "run_chain", "steps")
    wrap(runner, "forward", "fwd")
    wrap(drafter, "sample", "sample")
    return mark


def measure(ssd, seqs, marks: list, mark) -> tuple[dict[str, list[float]], list]:
    """The phases of 15 work-aheads (each after a look-up of outcome (0, 5)); the last one's marks."""

    def cycle() -> None:
        for s in seqs:
            ssd.note_outcome(s, 0, 5)
            s.apply_outcome(0, 5, s.num_tokens + 1, s.round + 1)
        ssd.propose(seqs, K)

    got: dict[str, list[float]] = {name: [] for name, _, _ in SPANS}
    got["work-ahead"], got["forwards GPU"] = [], []
    for _ in range(15):
        cycle()
        torch.cuda.synchronize()
        marks.clear()
        mark("start")
        t0 = time.perf_counter()
        ssd.work_ahead(seqs, K)
        got["work-ahead"].append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        rows = [(n, 1e3 * (h - marks[0][1]), marks[0][2].elapsed_time(e)) for n, h, e in marks]
        first: dict[str, float] = {}
        for n, h, _ in rows:
            first.setdefault(n, h)
        for name, a, b in SPANS:
            got[name].append(first[b] - first[a])  # a phase's first run (the layout's: before the forks)
        got["forwards GPU"].append(sum(rows[i + 1][2] - rows[i][2] for i in range(len(rows) - 1)
                                       if rows[i][0] == "fwd>"))
    return got, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("batch", type=int, nargs="?")
    p.add_argument("branches", type=int, nargs="?")
    p.add_argument("context", type=int, nargs="?")
    p.add_argument("oracle", nargs="?", default="oracle", choices=("oracle", "nooracle"))
    p.add_argument("--configs", default="", help="BATCH:BRANCHES:CONTEXT:oracle|nooracle,... in turn in one "
                                                 "process (instead of the positional arguments)")
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--layouts", default="early,late")
    p.add_argument("--forks", default="device")
    args = p.parse_args()
    torch.set_num_threads(1)
    configs = [tuple(c.split(":")) for c in args.configs.split(",") if c]
    if not configs:
        if args.context is None:
            p.error("give BATCH BRANCHES CONTEXT or --configs")
        configs = [(args.batch, args.branches, args.context, args.oracle)]
    for batch, branches, context, oracle in configs:
        run(int(batch), int(branches), int(context), oracle, args)
        torch.cuda.empty_cache()


def run(batch: int, branches: int, context: int, oracle: str, args) -> None:
    runner, drafter, ssd, seqs = build(batch, branches, context, oracle == "oracle")
    for _ in range(5):  # untimed
        for s in seqs:
            ssd.note_outcome(s, 0, 5)
            s.apply_outcome(0, 5, s.num_tokens + 1, s.round + 1)
        ssd.propose(seqs, K)
        ssd.work_ahead(seqs, K)
    marks: list = []
    mark = instrument(ssd, drafter, runner, marks)
    early, calls = ssd._layout, []

    def late(seqs, counts, k):  # a work-ahead's first call (before the forks) lays nothing out
        calls.append(1)
        return None if len(calls) % 2 else early(seqs, counts, k)

    pairs = [(order, forks) for order in args.layouts.split(",") for forks in args.forks.split(",")]
    for order, forks in pairs * 2:
        calls.clear()
        ssd._layout = early if order == "early" else late
        ssd.forks_on_device = forks == "device"
        got, rows = measure(ssd, seqs, marks, mark)
        print(f"batch {batch}, {branches} branches, context {context}, {oracle}, layout {order}, "
              f"forks on the {forks}, medians of 15 work-aheads (host ms): "
              + ", ".join(f"{n} {np.median(v):.3f}" for n, v in got.items()), flush=True)
        if args.timeline:
            print(f"{'mark':<16}{'host ms':>9}{'gpu ms':>9}")
            for n, h, g in rows:
                print(f"{n:<16}{h:>9.3f}{g:>9.3f}")


if __name__ == "__main__":
    main()
