"""The projections of one decoder layer at one token: the one-token Triton kernel
(kernels/small_linear.py: norms, residual adds and SiLU-and-mul folded in), with each of
its candidate block sizes, against cuBLAS with the separate fused small ops the layers
run around it, for the four model shapes of docs/benchmarks.md.

Each variant is captured in a CUDA graph of REPS calls back to back (as the runtime
replays a forward) and timed with CUDA events; the figure is us per call. The calls
cycle over enough copies of the layer's weights (at least COPY_BYTES) that they
stream from memory as in a forward instead of staying in L2 (50 MB on an H100).
Needs a CUDA GPU.

    python3 scripts/bench_linear.py --out bench/results/bench_linear_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPS = 24
COPY_BYTES = 400e6  # 8x an H100's L2


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="draft-0.6b,draft-1b,target-8b,target-32b")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from spec_runtime.bench.random_models import BENCH_ARCHS
    from spec_runtime.kernels.compiled import compiled
    from spec_runtime.kernels.small_linear import candidates, small_linear
    from spec_runtime.layers.activation import silu_mul
    from spec_runtime.layers.norm import add_rms_norm

    dev = torch.device("cuda")
    bf = torch.bfloat16
    add_rmsnorm, fused_silu_mul = compiled(add_rms_norm), compiled(silu_mul)

    def timed(fn) -> float:
        """us per call of fn(i), for i in range(REPS) per graph replay."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(2):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(REPS):
                fn(i)
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
        layer_bytes = 2 * (qkv_n * h + h * a.q_size + 2 * i * h + h * i)
        copies = min(REPS, math.ceil(COPY_BYTES / layer_bytes))
        ws = [dict(qkv=torch.randn(qkv_n, h, device=dev, dtype=bf) / h ** 0.5,
                   o=torch.randn(h, a.q_size, device=dev, dtype=bf) / a.q_size ** 0.5,
                   gate_up=torch.randn(2 * i, h, device=dev, dtype=bf) / h ** 0.5,
                   down=torch.randn(h, i, device=dev, dtype=bf) / i ** 0.5) for _ in range(copies)]
        g1 = torch.ones(h, device=dev, dtype=bf)
        res = torch.randn(1, h, device=dev, dtype=bf)
        res2 = torch.randn(1, h, device=dev, dtype=bf)
        attn = torch.zeros(1, a.q_size, device=dev, dtype=bf)  # zero: the in-place adds leave res as is
        act = torch.zeros(1, i, device=dev, dtype=bf)
        W = lambda n, k: ws[k % copies][n]  # noqa: E731
        fused = {  # (call(block, rep), K, norm, silu_mul)
            "qkv": (lambda b, r: small_linear(res, W("qkv", r), norm_weight=g1, eps=1e-5, block=b), h, True, False),
            "o": (lambda b, r: small_linear(attn, W("o", r), add_to=res, block=b), a.q_size, False, False),
            "gate_up": (lambda b, r: small_linear(res, W("gate_up", r), norm_weight=g1, eps=1e-5, silu_mul=True,
                                                  block=b), h, True, True),
            "down": (lambda b, r: small_linear(act, W("down", r), add_to=res, block=b), i, False, False),
        }
        lin = torch.nn.functional.linear
        unfused = {
            # The decoder layer's own sequence: the down output's residual add lives in
            # the next layer's add-RMSNorm, counted with qkv.
            "qkv": lambda r: lin(add_rmsnorm(res2, res, g1, 1e-5)[0], W("qkv", r)),
            "o": lambda r: add_rmsnorm(lin(attn, W("o", r)), res, g1, 1e-5)[0],
            "gate_up": lambda r: fused_silu_mul(lin(res, W("gate_up", r))),
            "down": lambda r: lin(act, W("down", r)),
        }
        row = {"model": name, "layer_mb": layer_bytes / 1e6, "weight_copies": copies}
        with torch.inference_mode():
            for k, (call, kk, norm, silu) in fused.items():
                blocks = candidates(kk, norm=norm, silu_mul=silu)
                us = {b: timed(lambda r, b=b: call(b, r)) for b in blocks}
                best = min(us, key=us.get)
                row[k] = {"cublas_us": timed(unfused[k]), "default_us": us[blocks[0]], "best_us": us[best],
                          "default_block": blocks[0], "best_block": best,
                          "all_us": {"x".join(map(str, b)): round(t, 2) for b, t in us.items()}}
        for v in ("cublas", "default", "best"):
            row[f"layer_{v}_us"] = sum(row[k][f"{v}_us"] for k in fused)
        rows.append(row)
        print(f"{name:11s} layer {layer_bytes / 1e6:6.1f} MB ({copies} copies): Triton default "
              f"{row['layer_default_us']:6.1f} us, best {row['layer_best_us']:6.1f} us "
              f"({layer_bytes / row['layer_best_us'] / 1e6:4.2f} TB/s), cuBLAS+ops {row['layer_cublas_us']:6.1f} us"
              "  | " + "  ".join(f"{k} {row[k]['default_us']:.1f}/{row[k]['best_us']:.1f}{row[k]['best_block']}"
                                  f"/{row[k]['cublas_us']:.1f}" for k in fused), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "reps": REPS,
                                              "command": " ".join(["scripts/bench_linear.py", *sys.argv[1:]]),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
