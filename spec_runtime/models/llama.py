"""The Llama family (Llama, SmolLM2, Qwen2, Qwen3) over a flat token batch, built from layers.

`model(input_ids [T], positions [T], batch) -> hidden [T, H]` runs every request of
a ForwardBatch at once; attention (and the KV pool) goes through the attention
backend the model is bound to. One forward serves CPU and CUDA: each layer picks its
kernel from the model's KernelPlan (kernels/plan.py), eager torch ops on CPU. The
families differ only in their ModelArch: biases on q/k/v (Qwen2), a per-head q/k
RMSNorm (Qwen3), tied embeddings, Llama 3.1 RoPE scaling. Numerics follow
transformers (RMSNorm in float32, RoPE cos/sin in float32 then cast), so float32
logits match it to ~1e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from spec_runtime.kernels.compiled import triton_kernels
from spec_runtime.kernels.plan import KernelPlan
from spec_runtime.layers.activation import SiluAndMul
from spec_runtime.layers.embedding import LMHead, VocabEmbedding
from spec_runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from spec_runtime.layers.norm import RMSNorm
from spec_runtime.layers.rotary import RotaryEmbedding, apply_rope
from spec_runtime.models.hf_config import ModelArch
from spec_runtime.models.weights import load_checkpoint


@dataclass
class StepContext:
    """What every layer of one forward reads: the batch, the attention backend and the
    KV pool it is bound to, and the step's RoPE tables (cos, sin [T, 1, D])."""

    batch: object  # ForwardBatch
    backend: object  # attention.AttentionBackend
    kv: object  # KVCache
    cos: torch.Tensor
    sin: torch.Tensor


class Attention(nn.Module):
    """This rank's heads: num_heads / tp and num_kv_heads / tp of them (tp = tensor-parallel size)."""

    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype, plan: KernelPlan, tp: dict) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.plan = plan
        n = tp["tp_size"]
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads // n, arch.num_kv_heads // n, arch.head_dim
        self.q_size, self.kv_size = arch.q_size // n, arch.kv_size // n
        self.eps = arch.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads,
                                          bias=arch.attention_bias, dtype=dtype, plan=plan, **tp)
        self.o_proj = RowParallelLinear(arch.q_size, arch.hidden_size, bias=arch.o_proj_bias, dtype=dtype, plan=plan,
                                        **tp)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, plan)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, plan)
        else:
            self.q_norm = self.k_norm = None

    def attend(self, qkv: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] -> attention output [T, Hq * D]; writes the step's K/V."""
        t, li, kv = qkv.shape[0], self.layer_idx, ctx.kv
        if self.plan.fused:
            qn = self.q_norm.weight if self.q_norm is not None else None
            kn = self.k_norm.weight if self.k_norm is not None else None
            # One kernel: split qkv, q/k norm, RoPE, and k/v written to their pool rows.
            rope_store_kv = triton_kernels().rope_store_kv
            q = rope_store_kv(qkv, ctx.cos, ctx.sin, kv.k_cache[li], kv.v_cache[li], ctx.batch.kv_write_rows,
                              num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              q_norm_w=qn, k_norm_w=kn, eps=self.eps)  # [T, Hq, D]
            o = ctx.backend.attend(li, q, kv, ctx.batch)  # [T, Hq, D]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D]
            k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
            o = ctx.backend.forward(li, q, k, v.contiguous(), kv, ctx.batch)  # [T, Hq, D]
        return o.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, plan: KernelPlan, tp: dict) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size], bias=False, dtype=dtype,
                                                       plan=plan, **tp)
        self.act = SiluAndMul(plan)
        self.down_proj = RowParallelLinear(size, arch.hidden_size, bias=False, dtype=dtype, plan=plan, **tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


# qkv [T, (Hq + 2 Hkv) D] -> attention output [T, Hq * D] (Attention.attend bound to a step).
Attend = Callable[[torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP. `attend` is the layer's attention bound to the
    step (the model passes Attention.attend; the kernel tuning passes a stand-in)."""

    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype, plan: KernelPlan, tp: dict) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, plan)
        self.self_attn = Attention(arch, layer_idx, dtype, plan, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, plan)
        self.mlp = MLP(arch, dtype, plan, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output [T, H] (the embeddings, with residual None, for
        the first layer). Returns (this layer's output, the residual stream before it is added)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn
        x = attn.o_proj(attend(attn.qkv_proj(h)))  # [T, H]
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual

    def one_token_projections(self) -> tuple[tuple[nn.Module, dict], ...]:
        """The four projections of a one-token step with what each folds in: qkv (input
        norm), o (added to the residual), gate_up (post-attention norm, SiLU-and-mul),
        down (added to the residual)."""
        attn, mlp = self.self_attn, self.mlp
        return ((attn.qkv_proj, dict(norm=self.input_layernorm)), (attn.o_proj, {}),
                (mlp.gate_up_proj, dict(norm=self.post_attention_layernorm, silu_mul=True)), (mlp.down_proj, {}))

    def forward_one_token(self, residual: torch.Tensor, attend: Attend) -> None:
        """The layer at one token on the one-token projection kernel, the norms, residual
        adds and SiLU-and-mul inside the four projections. residual [1, H] is updated in place."""
        (qkv_proj, qkv_kw), (o_proj, _), (gate_up_proj, gate_up_kw), (down_proj, _) = self.one_token_projections()
        qkv = qkv_proj.forward_one_token(residual, **qkv_kw)
        o_proj.forward_one_token(attend(qkv), add_to=residual)
        act = gate_up_proj.forward_one_token(residual, **gate_up_kw)  # [1, I]
        down_proj.forward_one_token(act, add_to=residual)


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied or not).

    Build it under `torch.device("meta")` and `to_empty` it to avoid initialising
    weights that are about to be overwritten; call `init_rope()` after that, and
    `bind(backend, kv)` before the first forward. `kernels` is the plan every layer
    reads (eager ops until the runner sets it for CUDA). With tp_size > 1 the model is
    rank tp_rank's shard (spec_runtime.engine.parallel): its heads, MLP columns and KV
    heads are 1/tp_size of the whole; embeddings, norms and the LM head are whole.
    """

    sliding_window_supported = False

    def __init__(self, arch: ModelArch, dtype: torch.dtype = torch.float32, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        if arch.sliding_window is not None and not self.sliding_window_supported:
            raise ValueError(f"{arch.model_type} with a sliding window is not supported")
        if arch.num_heads % tp_size or arch.num_kv_heads % tp_size or arch.intermediate_size % tp_size:
            raise ValueError(f"{arch.model_type} with {arch.num_heads} heads, {arch.num_kv_heads} kv heads and "
                             f"{arch.intermediate_size} MLP features does not split over {tp_size} ranks")
        self.arch = arch
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.num_kv_heads = arch.num_kv_heads // tp_size  # this rank's, in the KV pool
        tp = dict(tp_size=tp_size, tp_rank=tp_rank)
        self.kernels = KernelPlan()
        plan = self.kernels
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, plan)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, dtype, plan, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, plan)
        self.lm_head = None if arch.tie_word_embeddings else LMHead(arch.vocab_size, arch.hidden_size, dtype)
        self.backend = None  # attention.AttentionBackend, set by bind
        self.kv_cache = None  # KVCache, set by bind

    def init_rope(self) -> None:
        self.rotary_emb.init_tables(self.embed_tokens.weight.device)

    def bind(self, backend, kv) -> None:
        if kv.num_layers != self.arch.num_layers or kv.num_kv_heads != self.num_kv_heads \
                or kv.head_dim != self.arch.head_dim:
            raise ValueError(f"{kv} does not fit the model {self.arch}")
        self.backend = backend
        self.kv_cache = kv

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden [T, H]. The caller has run backend.begin(batch)."""
        if self.backend is None or self.kv_cache is None or self.rotary_emb.inv_freq is None:
            raise ValueError("call init_rope() and bind(backend, kv) before forward")
        x = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [T, 1, D] each
        ctx = StepContext(batch, self.backend, self.kv_cache, cos, sin)
        if self.kernels.folds_one_token(x.shape[0]):
            for layer in self.layers:
                # x is the residual stream, updated in place
                layer.forward_one_token(x, partial(layer.self_attn.attend, ctx=ctx))
            return self.norm(x)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, partial(layer.self_attn.attend, ctx=ctx))
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to our dtype/device); raise on unknown or missing ones."""
        load_checkpoint(self, weights, PACKED_MODULES, skip=self._skip)

    def _skip(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.lm_head is None)


# HF module name -> (our fused module, shard id).
PACKED_MODULES = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
