"""The projections of one decoder layer at decode/verify sizes: triton_linear.small_linear
(norms, residual adds and SiLU-and-mul fused in) against cuBLAS with the separate small
ops cuda_ops runs around it, for the model shapes of ../shared/BENCH.md.

Each variant is captured in a CUDA graph of REPS layers back to back (as the runtime
replays it) and timed with CUDA events; the figure is us per layer. The weights of
one layer stay in L2 across the repeats (up to 50 MB on an H100), so small shapes
read faster here than inside a forward. Needs a CUDA GPU.

    python3 scripts/bench_linear.py --out bench/results/bench_linear_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPS = 20


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="draft-0.6b,draft-1b,target-8b,target-32b")
    p.add_argument("--rows", default="1", help="token counts (M), at most triton_linear.MAX_ROWS")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from spec_runtime.model import cuda_ops
    from spec_runtime.model.random_init import BENCH_ARCHS
    from spec_runtime.model.triton_linear import block_sizes, small_linear

    dev = torch.device("cuda")
    bf = torch.bfloat16
    ops = cuda_ops.OPS

    def timed(fn) -> float:
        """us per call of fn, REPS calls per graph replay."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(REPS):
                fn()
        for _ in range(3):
            g.replay()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / REPS)
        times.sort()
        return times[len(times) // 2]

    rows = []
    for name in args.models.split(","):
        a = BENCH_ARCHS[name]
        h, i, qkv_n = a.hidden_size, a.intermediate_size, a.q_size + 2 * a.kv_size
        w_qkv = torch.randn(qkv_n, h, device=dev, dtype=bf) / h ** 0.5
        w_o = torch.randn(h, a.q_size, device=dev, dtype=bf) / a.q_size ** 0.5
        w_gu = torch.randn(2 * i, h, device=dev, dtype=bf) / h ** 0.5
        w_d = torch.randn(h, i, device=dev, dtype=bf) / i ** 0.5
        g1 = torch.ones(h, device=dev, dtype=bf)
        layer_bytes = 2 * (w_qkv.numel() + w_o.numel() + w_gu.numel() + w_d.numel())
        for m in (int(r) for r in args.rows.split(",")):
            res = torch.randn(m, h, device=dev, dtype=bf)
            res2 = torch.randn(m, h, device=dev, dtype=bf)
            attn = torch.randn(m, a.q_size, device=dev, dtype=bf)
            act = torch.randn(m, i, device=dev, dtype=bf)
            sizes = {"qkv": block_sizes(h, norm=True, silu_mul=False),
                     "o": block_sizes(a.q_size, norm=False, silu_mul=False),
                     "gate_up": block_sizes(h, norm=True, silu_mul=True),
                     "down": block_sizes(i, norm=False, silu_mul=False)}
            fused = {
                "qkv": lambda: small_linear(res, w_qkv, norm_weight=g1, eps=1e-5),
                "o": lambda: small_linear(attn, w_o, add_to=res),
                "gate_up": lambda: small_linear(res, w_gu, norm_weight=g1, eps=1e-5, silu_mul=True),
                "down": lambda: small_linear(act, w_d, add_to=res),
            }
            unfused = {
                # cuda_ops' own sequence: the down output's residual add lives in the next
                # layer's add_rmsnorm, counted with qkv.
                "qkv": lambda: torch.nn.functional.linear(ops.add_rmsnorm(res2, res, g1, 1e-5)[0], w_qkv),
                "o": lambda: ops.add_rmsnorm(torch.nn.functional.linear(attn, w_o), res, g1, 1e-5)[0],
                "gate_up": lambda: ops.silu_mul(torch.nn.functional.linear(res, w_gu)),
                "down": lambda: torch.nn.functional.linear(act, w_d),
            }
            with torch.inference_mode():
                row = {"model": name, "rows": m, "layer_mb": layer_bytes / 1e6,
                       "block_sizes": {k: dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), v)) for k, v in sizes.items()}}
                for k in fused:
                    row[f"{k}_fused_us"] = timed(fused[k])
                    row[f"{k}_cublas_us"] = timed(unfused[k])
                row["layer_fused_us"] = sum(row[f"{k}_fused_us"] for k in fused)
                row["layer_cublas_us"] = sum(row[f"{k}_cublas_us"] for k in fused)
            rows.append(row)
            print(f"{name:11s} M={m:2d} layer {layer_bytes / 1e6:6.1f} MB: fused {row['layer_fused_us']:7.1f} us "
                  f"({layer_bytes / row['layer_fused_us'] / 1e6:5.2f} TB/s), cuBLAS+ops {row['layer_cublas_us']:7.1f} us"
                  "  | " + "  ".join(f"{k} {row[f'{k}_fused_us']:.1f}/{row[f'{k}_cublas_us']:.1f}" for k in fused),
                  flush=True)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "reps": REPS,
                                              "command": " ".join(["scripts/bench_linear.py", *sys.argv[1:]]),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
