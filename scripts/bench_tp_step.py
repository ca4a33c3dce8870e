"""Target step latencies with tensor parallelism, against the bandwidth floor.

Builds the target's runner the way the target process does (target_proc.model: rank 0
starts ranks 1..N-1, NCCL, CUDA graphs with the all-reduces captured) for a random-weight
shape, and times `ModelRunner.run` on rank 0: the step broadcast to the other ranks,
the padded graph replay, and the greedy tokens to the host (one sync per step, as a
real step ends). Decode (q_len 1) and verify (q_len K+1) at each --batches size, every request with
--context tokens of KV. Floor: the bytes of weights a decode step reads on one GPU
(rank 0's shard) over the device-to-device copy bandwidth measured in the same run.

    python scripts/bench_tp_step.py --model target-32b --tp 1,2 --out tp_32b.json
    python scripts/bench_tp_step.py --model target-70b --tp 2 --out tp_70b.json

Shapes: spec_runtime.bench.random_models (target-70b is Llama-3-70B's: hidden 8192, 80
layers, intermediate 28672, 64 heads, 8 KV heads, vocabulary 128256).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_step import copy_bandwidth  # noqa: E402  (scripts/ is this file's directory)



def bench(shape: str, tp: int, args, bw: float, on_done) -> dict:
    from spec_runtime.bench.random_models import decode_read_bytes
    from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
    from spec_runtime.engine.forward_batch import ForwardItem
    from target_proc.model import start_tensor_parallel, target_runner

    batches = args.batches
    q_max = args.k + 1
    cfg = RuntimeConfig(
        target=ModelConfig(path=f"random:{shape}", device=args.device, tensor_parallel_size=tp,
                           gpu_memory_utilization=args.gpu_memory_utilization),
        spec=SpeculativeConfig(mode="sd", k=args.k),
        sched=SchedulerConfig(max_batch_size=max(batches), max_model_len=args.context + q_max + 16),
        startup_timeout_s=900.0)
    t0 = time.perf_counter()
    group = start_tensor_parallel(cfg)
    runner = target_runner(cfg, group)
    startup_s = time.perf_counter() - t0
    rbytes = decode_read_bytes(runner.model)
    floor_ms = rbytes / bw * 1e3 if bw else float("nan")
    per_seq = -(-(args.context + q_max) // runner.layout.block_size) * runner.layout.block_size

    def items(b: int, q: int):
        return [ForwardItem([7] * q, args.context, np.arange(s * per_seq, s * per_seq + args.context + q), "all")
                for s in range(b)]

    def time_run(its) -> float:
        for _ in range(args.warmup):
            runner.run(its).argmax(-1).cpu()  # sampled on the device, tokens to the host
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            runner.run(its).argmax(-1).cpu()  # sampled on the device, tokens to the host
            times.append((time.perf_counter() - t) * 1e3)
        return float(np.median(times))

    rows = []
    for q in (1, q_max):
        for b in batches:
            ms = time_run(items(b, q))
            rows.append(dict(kind="decode" if q == 1 else "verify", q_len=q, batch=b, ms=ms, floor_ms=floor_ms,
                             ratio=ms / floor_ms))
            print(f"{shape} tp={tp} {rows[-1]['kind']:6s} q={q} b={b:2d}: {ms:7.3f} ms  floor {floor_ms:6.3f}  "
                  f"x{ms / floor_ms:.2f}", flush=True)
    out = dict(model=shape, tp=tp, startup_s=startup_s, read_bytes_per_gpu=rbytes, floor_ms=floor_ms,
               kv_blocks=runner.layout.num_blocks, rows=rows)
    on_done(out)  # saved before the group is taken down
    if group is not None:
        group.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="target-32b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, each run in turn")
    p.add_argument("--k", type=int, default=8, help="verify steps run K+1 tokens per sequence")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--device", default="cuda:0", help="rank 0's device (cpu: a gloo check of the script, no floor)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.batches = tuple(int(x) for x in args.batches.split(","))
    import torch

    cuda = args.device.startswith("cuda")
    bw = copy_bandwidth(torch, torch.device(args.device)) if cuda else 0.0
    print(f"device-to-device copy: {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    data = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", num_gpus=torch.cuda.device_count(),
                torch=torch.__version__, python=platform.python_version(), copy_bw_tbs=bw / 1e12, context=args.context, k=args.k,
                command=" ".join(sys.argv), runs=[])
    def save(run: dict) -> None:
        data["runs"].append(run)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)

    for tp in (int(x) for x in args.tp.split(",")):
        bench(args.model, tp, args, bw, save)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    by_tp = {r["tp"]: {(x["kind"], x["batch"]): x["ms"] for x in r["rows"]} for r in data["runs"]}
    if 1 in by_tp and len(by_tp) > 1:
        for tp, steps in by_tp.items():
            if tp != 1:
                for key, ms in steps.items():
                    print(f"{key[0]:6s} b={key[1]:2d}: tp={tp} / tp=1 = {ms / by_tp[1][key]:.2f}", flush=True)


if __name__ == "__main__":
    main()
