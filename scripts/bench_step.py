"""Step latencies of the CUDA path against the bandwidth floor.

Builds the real-size random-weight models of docs/benchmarks.md on the GPU, measures
device-to-device copy bandwidth in the same run, and times, with CUDA events, the
median of --iters steps after --warmup:
  - decode (q_len 1) at batch 1..16 for every model (a draft's step is its decode),
  - verify (q_len K+1 for K+1 in --verify-q-lens) at batch 1..16 for the targets,
each beside its floor = weight bytes / measured bandwidth. A step is what
ModelRunner.forward does on a graph shape: copy inputs, plan attention, replay the
graph, LM head on the returned rows; each timed step ends with a sync, as a real
step does (sampled tokens go to the host). Every request has --context tokens of KV.
For target-8b and draft-1b it also times batch 1 with eager small ops in the graph
and with no graph, which is how the fused ops and the graphs are judged; for the
8B and the drafts, batch 1 with flashinfer's graph attention instead of the Triton
kernel, and an 8-step chain (each step's argmax fed to the next on the device, one
sync at the end: how the drafter runs its steps), reported per step.

    python scripts/bench_step.py --out bench.json [--models target-8b,draft-1b]

Writes JSON; `--plot-from bench.json --png out.png` makes the plot (on any machine
with matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCHES = (1, 2, 4, 8, 16)


def copy_bandwidth(torch, device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / float(np.median(times))


def time_step(torch, step, warmup: int, iters: int) -> float:
    """Median ms of step() between CUDA events, one sync per step."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def host_ms(torch, step, iters: int) -> float:
    """Median host ms of step() alone, the GPU idle before each call."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return float(np.median(times))


def bench_model(name: str, args, bw: float, log) -> dict:
    import torch

    from spec_runtime.attention.cuda import CudaAttentionBackend
    from spec_runtime.config import KernelConfig
    from spec_runtime.engine.cuda_graphs import CudaGraphRunner
    from spec_runtime.engine.forward_batch import ForwardItem, SlotLayout, build_forward_batch
    from spec_runtime.engine.kv_cache import KVCache
    from spec_runtime.bench.random_models import BENCH_ARCHS, decode_read_bytes, random_model, weight_bytes
    from spec_runtime.kernels.tuning import pick_small_linear, tune_small_linear

    dev = torch.device("cuda")
    arch = BENCH_ARCHS[name]
    is_target = name.startswith("target")
    t0 = time.perf_counter()
    kernels = KernelConfig()  # the defaults the runtime runs; the variants below change one choice each
    model = random_model(arch, dev)
    model.kernels.fused = kernels.fused_ops
    wbytes, rbytes = weight_bytes(model), decode_read_bytes(model)
    max_q = max(args.verify_q_lens) if is_target else 1
    layout = SlotLayout(max(BATCHES), args.context + max(max_q, 8))
    kv = KVCache(arch.num_layers, layout.num_rows + 1, arch.num_kv_heads, arch.head_dim, torch.bfloat16, dev)
    backend = CudaAttentionBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, torch.bfloat16, dev,
                                   graph_attention=kernels.attention_backend)
    model.bind(backend, kv)
    q_lens = (1, *args.verify_q_lens) if is_target else (1,)

    def fwd(ids, pos, batch):
        return model(ids, pos, batch)

    def make_graphs(max_batch_size=max(BATCHES), graph_q_lens=q_lens):
        with torch.inference_mode():
            g = CudaGraphRunner(fwd, model.backend, max_batch_size=max_batch_size, q_lens=graph_q_lens,
                                max_kv_len=layout.max_model_len, dummy_row=layout.num_rows, device=dev,
                                logits_fn=model.compute_logits)
            g.capture()
        return g

    # Warm-up eager forward (JIT, compile) before capture, as ModelRunner's sizing pass does,
    # and its choice of one-token projections.
    with torch.inference_mode():
        warm = build_forward_batch([ForwardItem(list(range(64)), 0, layout.slot_rows(0, 64), "last")], dev)
        backend.begin(warm)
        fwd(warm.input_ids, warm.positions, warm)
        t_tune = time.perf_counter()
        tuned = tune_small_linear(model)  # the runner's tuning step, its result recorded here
        t_tune = time.perf_counter() - t_tune
        for proj, (block, us, us_default) in tuned.items():
            log(f"{name:11s} small_linear {proj:7s} block {block}: {us:.1f} us/layer (default {us_default:.1f})")
        picked = pick_small_linear(model)
        log(f"{name:11s} one-token projections: Triton {picked[0]:.1f} us/layer, cuBLAS+ops {picked[1]:.1f}"
            f" -> {'Triton' if model.kernels.small_linear else 'cuBLAS'}")
        t1 = time.perf_counter()
        graphs = make_graphs()
    t_capture = time.perf_counter() - t1

    def batch_for(b: int, q: int):
        items = [ForwardItem([7] * q, args.context, layout.slot_rows(s, args.context + q), "all")
                 for s in range(b)]
        return build_forward_batch(items, dev)

    def graph_step(batch, g):
        def step():
            with torch.inference_mode():
                logits = g.run(batch)  # the graph includes the LM head
                logits[batch.logits_indices]
        return step

    def chain_step(batch, g, n):
        def step():
            with torch.inference_mode():
                prev = None
                for i in range(n):
                    b = batch_for_pos(1, 1, args.context + i)
                    if prev is not None:
                        b.input_ids.copy_(prev)
                    prev = g.run(b).argmax(-1)
        return step

    def batch_for_pos(b: int, q: int, pos: int):
        items = [ForwardItem([7] * q, pos, layout.slot_rows(s, pos + q), "last") for s in range(b)]
        return build_forward_batch(items, dev)

    def eager_step(batch):
        def step():
            with torch.inference_mode():
                backend.begin(batch)
                hidden = fwd(batch.input_ids, batch.positions, batch)
                model.compute_logits(hidden[batch.logits_indices])
        return step

    floor_ms = wbytes / bw * 1e3
    rows = []
    for q in q_lens:
        for b in BATCHES:
            batch = batch_for(b, q)
            ms = time_step(torch, graph_step(batch, graphs), args.warmup, args.iters)
            rows.append(dict(kind="decode" if q == 1 else "verify", q_len=q, batch=b, ms=ms,
                             floor_ms=floor_ms, ratio=ms / floor_ms))
            log(f"{name:11s} {rows[-1]['kind']:6s} q={q} b={b:2d}: {ms:7.3f} ms  floor {floor_ms:6.3f}  "
                f"x{ms / floor_ms:.2f}")
    extra = {}
    if name in ("target-8b", "draft-1b"):
        batch = batch_for(1, 1)
        extra["decode_b1_no_graph_fused_ms"] = time_step(torch, eager_step(batch), args.warmup, args.iters)
        model.kernels.fused = False  # eager small ops (KernelConfig.fused_ops off)
        try:
            extra["decode_b1_no_graph_eager_ops_ms"] = time_step(torch, eager_step(batch), args.warmup, args.iters)
            g2 = make_graphs(1, (1,))
            extra["decode_b1_graph_eager_ops_ms"] = time_step(torch, graph_step(batch, g2), args.warmup, args.iters)
            del g2
        finally:
            model.kernels.fused = True
    if name in ("target-8b", "draft-1b", "draft-0.6b"):
        batch = batch_for(1, 1)
        # The same step with flashinfer's graph attention (KernelConfig.attention_backend
        # flashinfer: planned on the host per step).
        fi_backend = CudaAttentionBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, torch.bfloat16, dev,
                                          graph_attention="flashinfer")
        model.bind(fi_backend, kv)
        try:
            g3 = make_graphs(1, (1,))
            extra["decode_b1_graph_flashinfer_ms"] = time_step(torch, graph_step(batch, g3), args.warmup, args.iters)
            del g3
        finally:
            model.bind(backend, kv)
            del fi_backend
        # The step with each kind of one-token projection forced (KernelConfig.small_linear
        # off / on): cuBLAS with separate norm and SiLU kernels, and the one-token kernel.
        setting = model.kernels.small_linear
        for forced, key in ((False, "decode_b1_graph_cublas_ms"), (True, "decode_b1_graph_small_linear_ms")):
            model.kernels.small_linear = forced
            try:
                g4 = make_graphs(1, (1,))
                extra[key] = time_step(torch, graph_step(batch, g4), args.warmup, args.iters)
                del g4
            finally:
                model.kernels.small_linear = setting
        # Host time of one step (no sync): what the GPU waits for before the graph runs;
        # and of the graph launch alone (replay with the inputs already in place).
        extra["decode_b1_host_ms"] = host_ms(torch, graph_step(batch, graphs), args.iters)
        extra["decode_b1_replay_host_ms"] = host_ms(torch, graphs.graphs[(1, 1, False)].graph.replay, args.iters)
        # A draft's steps as SSD and the chain drafter run them: 8 steps back to back,
        # each step's argmax fed to the next on the device, one sync at the end.
        extra["decode_b1_chain8_ms_per_step"] = time_step(
            torch, chain_step(batch, graphs, 8), args.warmup, args.iters) / 8
        # The table's b=1 step once more, last: whether the table's figure depends on when it was taken.
        extra["decode_b1_graph_again_ms"] = time_step(torch, graph_step(batch, graphs), args.warmup, args.iters)
        log(f"{name:11s} b=1 decode, graph: host {extra['decode_b1_host_ms']:.3f} ms "
            f"(replay alone {extra['decode_b1_replay_host_ms']:.3f}); "
            f"forced cuBLAS / Triton projections {extra['decode_b1_graph_cublas_ms']:.3f} / "
            f"{extra['decode_b1_graph_small_linear_ms']:.3f} ms; "
            f"flashinfer attention {extra['decode_b1_graph_flashinfer_ms']:.3f} ms; "
            f"8-step chain {extra['decode_b1_chain8_ms_per_step']:.3f} ms per step; "
            f"the table's step again {extra['decode_b1_graph_again_ms']:.3f} ms")
        if args.profile:
            profile_step(torch, graph_step(batch, graphs), f"{args.profile}", name)
    if "decode_b1_no_graph_fused_ms" in extra:
        log(f"{name:11s} b=1 decode: no-graph fused {extra['decode_b1_no_graph_fused_ms']:.3f} ms, "
            f"no-graph eager ops {extra['decode_b1_no_graph_eager_ops_ms']:.3f} ms, "
            f"graph eager ops {extra['decode_b1_graph_eager_ops_ms']:.3f} ms")
    out = dict(model=name, arch=dict(hidden=arch.hidden_size, layers=arch.num_layers,
                                     intermediate=arch.intermediate_size, heads=arch.num_heads,
                                     kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, vocab=arch.vocab_size,
                                     tied=arch.tie_word_embeddings),
               weight_bytes=wbytes, decode_read_bytes=rbytes, floor_ms=floor_ms,
               read_floor_ms=rbytes / bw * 1e3, build_s=t1 - t0, capture_s=t_capture,
               num_graphs=len(graphs.graphs), steps=rows,
               small_linear=model.kernels.small_linear, tune_s=t_tune,
               small_linear_blocks={k: dict(block=b, us=u, default_us=d) for k, (b, u, d) in tuned.items()},
               pick_small_linear_us=dict(zip(("triton", "cublas"), picked)), **extra)
    del graphs, model, kv, backend
    gc.collect()
    torch.cuda.empty_cache()
    return out


def profile_step(torch, step, path: str, name: str, steps: int = 5) -> None:
    """Append the top GPU kernels of `steps` steps (CUPTI sees kernels inside graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            table = avg.table(sort_by=key, row_limit=25, max_name_column_width=70)
            break
        except Exception:  # noqa: BLE001 - the sort key was renamed across torch versions
            table = avg.table(row_limit=25)
    with open(path, "a") as f:
        f.write(f"== {name}: {steps} decode steps at batch 1 (CUDA graph) ==\n{table}\n")


def plot(data: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = data["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for q in sorted({r["q_len"] for r in m["steps"]}):
            rs = [r for r in m["steps"] if r["q_len"] == q]
            ax.plot([r["batch"] for r in rs], [r["ms"] for r in rs], marker="o",
                    label="decode" if q == 1 else f"verify {q}")
        ax.axhline(m["floor_ms"], color="k", ls="--", label="bandwidth floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("step ms")
        ax.set_title(f"{m['model']} ({m['weight_bytes'] / 1e9:.1f} GB)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['device']}  copy {data['copy_bw_tbs']:.2f} TB/s  context {data['context']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="target-8b,draft-1b,draft-0.6b,target-32b")
    ap.add_argument("--verify-q-lens", default="2,4,6,8,9")
    ap.add_argument("--context", type=int, default=512, help="KV tokens already cached per request")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="bench_step.json")
    ap.add_argument("--profile", help="append a kernel-time table of batch-1 decode to this file")
    ap.add_argument("--plot-from", help="only plot this JSON (no GPU needed)")
    ap.add_argument("--png", help="PNG path for --plot-from")
    args = ap.parse_args(argv)
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f), args.png or args.plot_from.replace(".json", ".png"))
        return
    args.verify_q_lens = tuple(int(x) for x in args.verify_q_lens.split(","))
    logging.basicConfig(level=logging.WARNING)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_step.py needs a CUDA device")

    def log(msg: str) -> None:
        print(msg, flush=True)

    dev = torch.device("cuda")
    bw = copy_bandwidth(torch, dev)
    log(f"device-to-device copy: {bw / 1e12:.3f} TB/s (read + write)")
    data = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(dev),
                torch=torch.__version__, python=platform.python_version(), copy_bw_tbs=bw / 1e12,
                context=args.context, warmup=args.warmup, iters=args.iters, command=" ".join(sys.argv),
                models=[], skipped={})
    try:
        import flashinfer
        data["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001 - version is informational
        pass
    for name in args.models.split(","):
        try:
            data["models"].append(bench_model(name, args, bw, log))
        except torch.OutOfMemoryError as e:
            data["skipped"][name] = f"out of memory: {str(e).splitlines()[0]}"
            log(f"{name}: skipped, out of memory")
            gc.collect()
            torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
