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
model and the GPU. In scripts/bench_linear.py it took less time per layer than cuBLAS
plus the ops for every BENCH.md shape on an H100 (20-40% less for the draft shapes,
2-12% for 8B and 32B) and for the draft shapes on an H200 (17-50%), but 4-7% more
for the 8B and 32B shapes on the H200, whose cuBLAS GEMVs reach higher bandwidth.
So `pick_small_linear(model)` times both on the model's own first layers at start-up
(ModelRunner calls it before capturing graphs) and keeps the faster.
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


@torch.inference_mode()
def pick_small_linear(model, max_layers: int = 8) -> tuple[float, float] | None:
    """Time the projections of the model's first layers at one token, with small_linear
    and with cuBLAS plus the separate ops; set model.small_linear to whether the first
    is faster. Returns (small_linear, cuBLAS) us per layer. Each layer's own weights, so
    they come from memory, as in a forward. Needs the fused ops (OPS.fused). Returns
    None, timing nothing, where SPEC_RUNTIME_SMALL_LINEAR forces the choice."""
    if OPS.small_linear is not None:
        logger.info("one-token projections: %s (forced)", "Triton" if OPS.small_linear else "cuBLAS")
        return None
    layers = model.layers[:max_layers]
    w = model.embed_tokens.weight
    arch = model.arch
    res = torch.randn(1, arch.hidden_size, device=w.device, dtype=w.dtype)
    res2 = torch.randn_like(res)
    # Zero attention output and activation: the in-place residual adds leave res as is.
    attn_out = torch.zeros(1, arch.q_size, device=w.device, dtype=w.dtype)
    act = torch.zeros(1, arch.intermediate_size, device=w.device, dtype=w.dtype)

    def fused() -> None:
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            small_linear(res, attn.qkv_proj.weight, bias=attn.qkv_proj.bias, norm_weight=ln1.weight, eps=ln1.eps)
            small_linear(attn_out, attn.o_proj.weight, bias=attn.o_proj.bias, add_to=res)
            small_linear(res, mlp.gate_up_proj.weight, norm_weight=ln2.weight, eps=ln2.eps, silu_mul=True)
            small_linear(act, mlp.down_proj.weight, add_to=res)

    def unfused() -> None:  # the sequence cuda_forward runs at larger sizes
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            h, r = OPS.add_rmsnorm(res2, res, ln1.weight, ln1.eps)
            attn.qkv_proj(h)
            h, r = OPS.add_rmsnorm(attn.o_proj(attn_out), r, ln2.weight, ln2.eps)
            mlp.down_proj(OPS.silu_mul(mlp.gate_up_proj(h)))

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


def _layers_small(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: ForwardBatch) -> torch.Tensor:
    """The decoder layers for <= MAX_ROWS tokens: four small_linear calls per layer
    with the norms, residual adds and SiLU-and-mul inside. Returns the residual stream."""
    residual = x  # [T, H], updated in place by the o and down projections
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        qkv = small_linear(residual, attn.qkv_proj.weight, bias=attn.qkv_proj.bias,
                           norm_weight=ln1.weight, eps=ln1.eps)  # [T, (Hq + 2 Hkv) D]
        o = _attend(model, layer, qkv, cos, sin, batch)  # [T, Hq * D]
        small_linear(o, attn.o_proj.weight, bias=attn.o_proj.bias, add_to=residual)
        act = small_linear(residual, mlp.gate_up_proj.weight, norm_weight=ln2.weight, eps=ln2.eps,
                           silu_mul=True)  # [T, I]
        small_linear(act, mlp.down_proj.weight, add_to=residual)
    return residual


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
    if ops.fused and t <= MAX_ROWS and _uses_small_linear(model):
        residual = _layers_small(model, x, cos, sin, batch)
        return ops.rmsnorm(residual, model.norm.weight, model.norm.eps)
    residual = None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        ln1 = layer.input_layernorm
        if residual is None:
            residual = x
            h = ops.rmsnorm(x, ln1.weight, ln1.eps)
        else:
            h, residual = ops.add_rmsnorm(x, residual, ln1.weight, ln1.eps)
        o = _attend(model, layer, attn.qkv_proj(h), cos, sin, batch)  # [T, Hq * D]
        x = attn.o_proj(o)  # [T, H]
        ln2 = layer.post_attention_layernorm
        h, residual = ops.add_rmsnorm(x, residual, ln2.weight, ln2.eps)
        x = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(h)))  # [T, H]
    hidden, _ = ops.add_rmsnorm(x, residual, model.norm.weight, model.norm.eps)
    return hidden
