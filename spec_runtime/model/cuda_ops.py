"""The CUDA forward of LlamaForCausalLM: the same math as llama.py with fused small ops.

At batch 1 a decode step of an 8B model is ~13 GEMVs per layer worth of bandwidth,
but llama.py's eager RMSNorm (7 kernels), RoPE (5 per tensor) and SiLU-and-mul
(2) add ~30 tiny kernels per layer, each costing 2-3 us even inside a CUDA graph:
~3 ms per step, half the bandwidth floor. Here each of those is one Triton kernel
made by torch.compile:

    add_rmsnorm     residual add + RMSNorm (2 per layer)
    silu_mul        SiLU(gate) * up
    rope_cos_sin    cos/sin of the step's positions (once per forward)

and one hand-written Triton kernel (triton_kernels.rope_store_kv) splits the fused
qkv output, applies the optional q/k RMSNorm (Qwen3) and RoPE, and writes k and v to
their pool rows, so the attention backend only attends (`backend.attend`). A layer is
~10 kernels: 2 norms, 4 GEMMs, rope+store, attention (2 with split kv), silu_mul.
`cuda_forward` reads the parameters of a LlamaForCausalLM, so weights are loaded
once by llama.py's loader; the CPU path (model.forward) is untouched. Numerics
follow llama.py (float32 norm statistics, bf16 residual stream); the fused
kernels round at fewer points, which tests/test_gpu.py bounds against the CPU path.

With one token (triton_linear.MAX_ROWS), a decode or draft step of one sequence, the
projections can be triton_linear.small_linear with the norms, the residual adds and
SiLU-and-mul folded in: 7 kernels per layer (4 projections, rope+store, attention
and its split merge) where there were 11. Whether that is faster depends on the
model, its block sizes and the GPU (the H200's cuBLAS GEMVs reach higher bandwidth
for the 8B and 32B shapes than a kernel with untuned blocks). So at start-up (ModelRunner, before
capturing graphs) `pick_small_linear(model)` first tunes small_linear's block sizes
per projection shape on the model's own weights (`tune_small_linear`), then times
both variants on its first layers and keeps the faster.
SPEC_RUNTIME_SMALL_LINEAR=1 or 0 (or `set_small_linear`) forces either.

`set_fused_ops(False)` (or SPEC_RUNTIME_FUSED_OPS=0) runs the same function with eager
torch ops instead; the benchmark measures both. Compile cost is paid once per process
and shape class (T = 1 and T > 1).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from spec_runtime.model.forward_batch import ForwardBatch
from spec_runtime.model.triton_kernels import rope_store_kv
from spec_runtime.model.triton_linear import MAX_ROWS, small_linear

logger = logging.getLogger(__name__)


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); the residual stream stays in x's dtype."""
    s = x + residual
    return _rmsnorm(s, weight, eps), s


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _qk_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D] rotated, v [T, Hkv, D]."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, num_kv_heads, head_dim)
    v = v.reshape(t, num_kv_heads, head_dim)
    if q_norm_w is not None:
        q = _rmsnorm(q, q_norm_w, eps)
        k = _rmsnorm(k, k_norm_w, eps)
    return _rope(q, cos, sin), _rope(k, cos, sin), v.contiguous()


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2] fp32
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class _Ops:
    """The op table cuda_forward calls: eager functions or their compiled versions."""

    def __init__(self) -> None:
        self.fused = False
        # None: per model, as pick_small_linear decided; True/False: forced.
        forced = os.environ.get("SPEC_RUNTIME_SMALL_LINEAR", "auto")
        self.small_linear: bool | None = None if forced == "auto" else forced != "0"
        # Compilation is lazy (first call), so enabling it here costs nothing on a CPU host.
        self.set(os.environ.get("SPEC_RUNTIME_FUSED_OPS", "1") != "0")

    def set(self, fused: bool) -> None:
        if fused:
            # dynamic=True: one kernel per op for every token count (T) and every model
            # width, instead of a recompile per captured batch size.
            opts = dict(dynamic=True, fullgraph=True)
            self.rmsnorm = torch.compile(_rmsnorm, **opts)
            self.add_rmsnorm = torch.compile(_add_rmsnorm, **opts)
            self.silu_mul = torch.compile(_silu_mul, **opts)
            self.rope_cos_sin = torch.compile(_rope_cos_sin, **opts)
        else:
            self.rmsnorm, self.add_rmsnorm = _rmsnorm, _add_rmsnorm
            self.silu_mul, self.rope_cos_sin = _silu_mul, _rope_cos_sin
        self.fused = fused


OPS = _Ops()


def set_fused_ops(fused: bool) -> None:
    """Use torch.compile'd fused small ops (True) or eager torch ops (False), process-wide."""
    if fused != OPS.fused:
        OPS.set(fused)
        logger.info("fused small ops: %s", "torch.compile" if fused else "eager")


def fused_ops_enabled() -> bool:
    return OPS.fused


def set_small_linear(enabled: bool | None) -> None:
    """Force triton_linear.small_linear for one-token forwards (True) or cuBLAS (False);
    None: each model as pick_small_linear decided (cuBLAS where it did not run)."""
    OPS.small_linear = enabled


def _uses_small_linear(model) -> bool:
    return OPS.small_linear if OPS.small_linear is not None else model.small_linear


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


_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def _projections(layer) -> tuple[dict, dict, dict, dict]:
    """small_linear's arguments for a layer's four one-token projections, in order: qkv
    (input norm folded in), o (added to the residual by the caller), gate_up
    (post-attention norm and SiLU-and-mul folded in), down (added to the residual)."""
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    return (dict(weight=attn.qkv_proj.weight, bias=attn.qkv_proj.bias, norm_weight=ln1.weight, eps=ln1.eps),
            dict(weight=attn.o_proj.weight, bias=attn.o_proj.bias),
            dict(weight=mlp.gate_up_proj.weight, norm_weight=ln2.weight, eps=ln2.eps, silu_mul=True),
            dict(weight=mlp.down_proj.weight))


def _layer_small(layer, residual: torch.Tensor, attend) -> None:
    """One decoder layer at one token (triton_linear.MAX_ROWS) with four small_linear
    calls; the norms, residual adds and SiLU-and-mul are inside them. attend: qkv
    [1, (Hq + 2 Hkv) D] -> attention output [1, Hq * D]. residual [1, H] is updated in place."""
    qkv_args, o_args, gate_up_args, down_args = _projections(layer)
    qkv = small_linear(residual, **qkv_args)
    small_linear(attend(qkv), add_to=residual, **o_args)
    act = small_linear(residual, **gate_up_args)  # [1, I]
    small_linear(act, add_to=residual, **down_args)


def _layer(layer, x: torch.Tensor, residual: torch.Tensor | None, attend) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer with cuBLAS projections and OPS' norms and SiLU-and-mul.
    x: the previous layer's output [T, H] (the embeddings, with residual None, for the
    first layer). Returns (this layer's output, the residual stream before it is added)."""
    ops, attn, mlp = OPS, layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    if residual is None:
        residual = x
        h = ops.rmsnorm(x, ln1.weight, ln1.eps)
    else:
        h, residual = ops.add_rmsnorm(x, residual, ln1.weight, ln1.eps)
    x = attn.o_proj(attend(attn.qkv_proj(h)))  # [T, H]
    h, residual = ops.add_rmsnorm(x, residual, ln2.weight, ln2.eps)
    return mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(h))), residual


@torch.inference_mode()
def tune_small_linear(model) -> dict[str, tuple[tuple[int, int, int], float, float]]:
    """Choose small_linear's block sizes for each of the model's four projection shapes.

    Each of triton_linear.candidates is timed in a CUDA graph running that projection
    for every layer, each layer with its own weights, so they stream from memory as
    in a forward (one layer's weights would stay in L2 across repeats). The fastest is
    recorded with triton_linear.set_block_sizes. Shapes this process already tuned are
    skipped. Returns {projection: (block, its us per layer, the default's us per layer)}
    for the shapes it tuned."""
    from tqdm import tqdm

    from spec_runtime.model import triton_linear

    layers = model.layers
    w = model.embed_tokens.weight
    arch = model.arch
    res = torch.randn(1, arch.hidden_size, device=w.device, dtype=w.dtype)
    # Zero attention output and activation: the in-place residual adds leave res as is.
    attn_out = torch.zeros(1, arch.q_size, device=w.device, dtype=w.dtype)
    act = torch.zeros(1, arch.intermediate_size, device=w.device, dtype=w.dtype)
    inputs, add_to = (res, attn_out, res, act), (None, res, None, res)
    todo = []
    for j, name in enumerate(_PROJECTIONS):
        args = _projections(layers[0])[j]
        rows, k = args["weight"].shape
        shape = dict(norm=args.get("norm_weight") is not None, silu_mul=args.get("silu_mul", False))
        if not triton_linear.is_tuned(rows, k, **shape):
            todo.append((j, name, rows, k, shape, triton_linear.candidates(k, **shape)))
    out = {}
    with tqdm(total=sum(len(c) for *_, c in todo), desc="tuning one-token projections", unit="config",
              leave=False) as bar:
        for j, name, rows, k, shape, blocks in todo:
            calls = [_projections(layer)[j] for layer in layers]

            def run(block) -> None:
                for args in calls:
                    small_linear(inputs[j], add_to=add_to[j], block=block, **args)

            us = {}
            for block in blocks:
                us[block] = _graph_us(lambda: run(block), replays=7) / len(layers)
                bar.update()
            best = min(us, key=us.get)
            triton_linear.set_block_sizes(rows, k, **shape, block=best)
            out[name] = (best, us[best], us[blocks[0]])
            logger.info("small_linear %s [%d, %d]: block %s, %.1f us per layer (default %s: %.1f)",
                        name, rows, k, best, us[best], blocks[0], us[blocks[0]])
    return out


@torch.inference_mode()
def pick_small_linear(model, max_layers: int = 8) -> tuple[float, float] | None:
    """Tune small_linear's block sizes for the model (tune_small_linear), then time the
    projections of its first layers at one token with small_linear and with cuBLAS plus
    the separate ops; set model.small_linear to whether the first is faster. Returns
    (small_linear, cuBLAS) us per layer. Each layer's own weights, so they come from
    memory, as in a forward. Needs the fused ops (OPS.fused). Where
    SPEC_RUNTIME_SMALL_LINEAR forces the choice it times nothing and returns None
    (forced on, it still tunes). SPEC_RUNTIME_TUNE_SMALL_LINEAR=0 skips the tuning."""
    if OPS.small_linear is not False and os.environ.get("SPEC_RUNTIME_TUNE_SMALL_LINEAR", "1") != "0":
        tune_small_linear(model)
    if OPS.small_linear is not None:
        logger.info("one-token projections: %s (forced)", "Triton" if OPS.small_linear else "cuBLAS")
        return None
    layers = model.layers[:max_layers]
    w = model.embed_tokens.weight
    arch = model.arch
    res0 = torch.randn(1, arch.hidden_size, device=w.device, dtype=w.dtype)
    res, res2 = torch.empty_like(res0), torch.randn_like(res0)
    attn_out = torch.randn(1, arch.q_size, device=w.device, dtype=w.dtype)

    def attend(qkv: torch.Tensor) -> torch.Tensor:  # attention is the same in both: left out
        return attn_out

    def fused() -> None:
        res.copy_(res0)  # the layers add to res in place: the same input every replay
        for layer in layers:
            _layer_small(layer, res, attend)

    def unfused() -> None:  # the sequence cuda_forward runs at larger sizes
        res.copy_(res0)
        x, r = res2, res
        for layer in layers:
            x, r = _layer(layer, x, r, attend)

    us_small, us_cublas = (_graph_us(f) / len(layers) for f in (fused, unfused))
    model.small_linear = us_small < us_cublas
    logger.info("one-token projections: %s (Triton %.1f us per layer, cuBLAS and separate ops %.1f)",
                "Triton" if model.small_linear else "cuBLAS", us_small, us_cublas)
    return us_small, us_cublas


def _attend(model, layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            batch: ForwardBatch) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> attention output [T, Hq * D]; writes the step's K/V."""
    arch, attn, kv = model.arch, layer.self_attn, model.kv_cache
    qn = attn.q_norm.weight if attn.q_norm is not None else None
    kn = attn.k_norm.weight if attn.k_norm is not None else None
    li = attn.layer_idx
    if OPS.fused:
        q = rope_store_kv(qkv, cos, sin, kv.k_cache[li], kv.v_cache[li], batch.kv_write_rows,
                          num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                          q_norm_w=qn, k_norm_w=kn, eps=arch.rms_norm_eps)  # [T, Hq, D]
        o = model.backend.attend(li, q, kv, batch)  # [T, Hq, D]
    else:
        q, k, v = _qk_rope(qkv, cos, sin, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                          qn, kn, arch.rms_norm_eps)
        o = model.backend.forward(li, q, k, v, kv, batch)  # [T, Hq, D]
    return o.reshape(qkv.shape[0], arch.q_size)


def cuda_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """input_ids/positions [T] -> final-normed hidden [T, H], as model.forward computes it.

    `model` is a bound LlamaForCausalLM; the caller has run backend.begin(batch).
    """
    if model.backend is None or model.kv_cache is None or model.inv_freq is None:
        raise ValueError("call init_rope() and bind(backend, kv) before forward")
    ops = OPS
    x = model.embed_tokens(input_ids)  # [T, H]
    t = x.shape[0]
    cos, sin = ops.rope_cos_sin(positions, model.inv_freq, x.dtype)  # [T, 1, D] each

    def attend(layer):
        return lambda qkv: _attend(model, layer, qkv, cos, sin, batch)  # [T, Hq * D]

    if ops.fused and t <= MAX_ROWS and _uses_small_linear(model):
        residual = x  # updated in place by each layer's o and down projections
        for layer in model.layers:
            _layer_small(layer, residual, attend(layer))
        return ops.rmsnorm(residual, model.norm.weight, model.norm.eps)
    residual = None
    for layer in model.layers:
        x, residual = _layer(layer, x, residual, attend(layer))
    hidden, _ = ops.add_rmsnorm(x, residual, model.norm.weight, model.norm.eps)
    return hidden
