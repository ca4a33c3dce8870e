"""The start-up step that settles a model's one-token projections on CUDA.

`plan_one_token(model, cfg)` fills the model's KernelPlan (kernels/plan.py) from the
KernelConfig: it tunes the one-token kernel's block sizes on the model's own weights
(`tune_small_linear`), then, with small_linear "auto", times a few layers' projections
with that kernel and with cuBLAS plus the fused small ops, and keeps the faster
(`pick_small_linear`). The runner calls it once, after sizing the KV pool and before
capturing CUDA graphs (the graphs bake the choice in). docs/kernels.md says why.
"""

from __future__ import annotations

import logging

import torch

from spec_runtime.config import KernelConfig

logger = logging.getLogger(__name__)

_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def _graph_us(fn, replays: int = 5) -> float:
    """Median us of one replay of a CUDA graph of fn (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()  # sync: start-up timing, once per model
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def _shape(linear, kw: dict) -> tuple[int, int, dict]:
    """(weight rows, K, {norm, silu_mul}): the key of a projection's block sizes."""
    rows, k = linear.weight.shape
    return rows, k, dict(norm=kw.get("norm") is not None, silu_mul=kw.get("silu_mul", False))


@torch.inference_mode()
def tune_small_linear(model) -> dict[str, tuple[tuple[int, int, int], float, float]]:
    """Choose the one-token kernel's block sizes for each of the model's four projection shapes.

    Each of small_linear.candidates is timed in a CUDA graph running that projection
    for every layer, each layer with its own weights, so they stream from memory as
    in a forward (one layer's weights would stay in L2 across repeats). The fastest is
    recorded in model.kernels.blocks; shapes already there are skipped. Returns
    {projection: (block, its us per layer, the default's us per layer)} for the shapes it tuned."""
    from tqdm import tqdm

    from spec_runtime.kernels.small_linear import candidates

    layers, table = model.layers, model.kernels.blocks
    w = model.embed_tokens.weight
    arch = model.arch
    res = torch.randn(1, arch.hidden_size, device=w.device, dtype=w.dtype)
    # Zero attention output and activation: the in-place residual adds leave res as is.
    attn_out = torch.zeros(1, arch.q_size, device=w.device, dtype=w.dtype)
    act = torch.zeros(1, arch.intermediate_size, device=w.device, dtype=w.dtype)
    inputs, add_to = (res, attn_out, res, act), (None, res, None, res)
    todo = []
    for j, name in enumerate(_PROJECTIONS):
        rows, k, shape = _shape(*layers[0].one_token_projections()[j])
        if not table.is_tuned(rows, k, **shape):
            todo.append((j, name, rows, k, shape, candidates(k, **shape)))
    out = {}
    with tqdm(total=sum(len(c) for *_, c in todo), desc="tuning one-token projections", unit="config",
              leave=False) as bar:
        for j, name, rows, k, shape, blocks in todo:
            calls = [layer.one_token_projections()[j] for layer in layers]

            def run(block) -> None:
                for linear, kw in calls:
                    linear.forward_one_token(inputs[j], add_to=add_to[j], block=block, **kw)

            us = {}
            for block in blocks:
                us[block] = _graph_us(lambda: run(block), replays=7) / len(layers)
                bar.update()
            best = min(us, key=us.get)
            table.set(rows, k, **shape, block=best)
            out[name] = (best, us[best], us[blocks[0]])
            logger.info("small_linear %s [%d, %d]: block %s, %.1f us per layer (default %s: %.1f)",
                        name, rows, k, best, us[best], blocks[0], us[blocks[0]])
    return out


@torch.inference_mode()
def pick_small_linear(model, max_layers: int = 8) -> tuple[float, float]:
    """Time the projections of the model's first layers at one token with the one-token
    kernel and with cuBLAS plus the separate fused ops; set model.kernels.small_linear to
    whether the first is faster. Returns (small_linear, cuBLAS) us per layer. Each
    layer's own weights, so they come from memory, as in a forward. Attention is the
    same in both and left out. Needs model.kernels.fused."""
    layers = model.layers[:max_layers]
    w = model.embed_tokens.weight
    arch = model.arch
    res0 = torch.randn(1, arch.hidden_size, device=w.device, dtype=w.dtype)
    res, res2 = torch.empty_like(res0), torch.randn_like(res0)
    attn_out = torch.randn(1, arch.q_size, device=w.device, dtype=w.dtype)

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        return attn_out

    def folded() -> None:
        res.copy_(res0)  # the layers add to res in place: the same input every replay
        for layer in layers:
            layer.forward_one_token(res, attend)

    def unfolded() -> None:  # the sequence the forward runs at larger sizes
        res.copy_(res0)
        x, r = res2, res
        for layer in layers:
            x, r = layer(x, r, attend)

    us_small, us_cublas = (_graph_us(f) / len(layers) for f in (folded, unfolded))
    model.kernels.small_linear = us_small < us_cublas
    logger.info("one-token projections: %s (Triton %.1f us per layer, cuBLAS and separate ops %.1f)",
                "Triton" if model.kernels.small_linear else "cuBLAS", us_small, us_cublas)
    return us_small, us_cublas


def plan_one_token(model, cfg: KernelConfig) -> dict:
    """Settle model.kernels' one-token projections as `cfg` asks (tune, then pick or
    force); returns what was decided and measured, for the start-up log and benchmarks."""
    plan = model.kernels
    if not plan.fused:
        plan.small_linear = False
        return dict(small_linear=False, reason="fused_ops off")
    report: dict = {}
    if cfg.small_linear != "off" and cfg.tune_small_linear:
        report["tuned"] = tune_small_linear(model)
    if cfg.small_linear != "auto":
        plan.small_linear = cfg.small_linear == "on"
        logger.info("one-token projections: %s (forced)", "Triton" if plan.small_linear else "cuBLAS")
        return dict(report, small_linear=plan.small_linear, reason="forced")
    report["picked_us"] = pick_small_linear(model)
    return dict(report, small_linear=plan.small_linear, reason="timed")
