"""The Triton paged attention of graph steps (kernels/paged.py) at the split counts a
graph could be captured with: for each model shape, batch, q_len (decode, K + 1 verify)
and context length, us per layer at the split count the runtime picks
(kernels/paged.py::num_splits_for) and at each of CANDIDATES. Needs a CUDA GPU.

Each point is captured in a CUDA graph of calls cycling over enough layers' KV (at least
COPY_BYTES) that it streams from memory as in a forward; the figure is us per call, and
`floor_us` the time to read the point's K and V once at the measured copy bandwidth.

    python3 scripts/bench_attention.py --out bench/results/bench_attention_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_BYTES = 400e6  # 8x an H100's L2
REPS = 32
SHAPES = {  # heads, kv heads, head dim
    "target-8b": (32, 8, 128),
    "target-32b": (64, 8, 128),
    "draft-1b": (32, 8, 64),
}
CANDIDATES = (1, 2, 3, 4, 5, 8, 9, 16, 32)  # powers of two, and 2 x SMs / (batch x kv heads) rounded up at batch 16, 8, 4


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="target-8b,target-32b,draft-1b")
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--q-lens", default="1,5,9")
    p.add_argument("--contexts", default="512,2048,4096,8192")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from spec_runtime.kernels.paged import MAX_TILE_M, num_splits_for, paged_attention

    dev = torch.device("cuda")
    bf = torch.bfloat16
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x = torch.empty(int(1e9), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        y.copy_(x)
    e1.record()
    torch.cuda.synchronize()
    copy_bw = 2 * 5 * x.numel() / (e0.elapsed_time(e1) / 1e3)  # bytes/s, read + write
    del x, y

    def timed(fn, n_layers: int) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(2):
                fn(i % n_layers)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(REPS):
                fn(i % n_layers)
        g.replay()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(3):
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) * 1e3 / REPS)
        return best

    rows = []
    for model in args.models.split(","):
        hq, hkv, d = SHAPES[model]
        for ctx in map(int, args.contexts.split(",")):
            for bs in map(int, args.batches.split(",")):
                n_rows = bs * ctx
                layer_bytes = 2 * n_rows * hkv * d * 2
                n_layers = max(1, min(REPS, math.ceil(COPY_BYTES / layer_bytes)))
                k = torch.randn(n_layers, n_rows, hkv, d, dtype=bf, device=dev)
                v = torch.randn_like(k)
                indptr = torch.arange(0, n_rows + 1, ctx, dtype=torch.int32, device=dev)
                indices = torch.arange(n_rows, dtype=torch.int32, device=dev)
                for q_len in map(int, args.q_lens.split(",")):
                    if q_len * (hq // hkv) > MAX_TILE_M:
                        continue
                    q = torch.randn(bs * q_len, hq, d, dtype=bf, device=dev)
                    runtime = num_splits_for(bs, hkv, num_sms, tile_rows=q_len * (hq // hkv))
                    us = {}
                    for splits in sorted({runtime, *CANDIDATES}):
                        us[splits] = timed(
                            lambda i: paged_attention(q, k[i], v[i], indptr, indices, q_len=q_len, num_splits=splits,
                                                      scale=d ** -0.5), n_layers)
                    best = min(us, key=us.get)
                    row = dict(model=model, batch=bs, q_len=q_len, context=ctx, runtime=runtime,
                               runtime_us=us[runtime], best=best, best_us=us[best],
                               floor_us=1e6 * layer_bytes / copy_bw, us=us)
                    rows.append(row)
                    print(f"{model:10} ctx {ctx:5d} b {bs:2d} q {q_len}: runtime {runtime:2d} splits "
                          f"{row['runtime_us']:7.1f} us, best {best:2d} {row['best_us']:7.1f} us, "
                          f"floor {row['floor_us']:6.1f} us | "
                          + " ".join(f"{c}:{t:.0f}" for c, t in us.items()), flush=True)
                del k, v
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), num_sms=num_sms, copy_bw_bytes_per_s=copy_bw,
                           reps=REPS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
