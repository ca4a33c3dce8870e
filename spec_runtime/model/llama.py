"""A Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) over a flat token batch.

`model(input_ids [T], positions [T], batch) -> hidden [T, H]` runs every request of
a ForwardBatch at once; attention (and the KV pool) goes through the attention
backend the model is bound to, so CPU SDPA and CUDA flashinfer share this file.
q/k/v and gate/up are fused into one matmul each; `load_weights` maps the HF names
onto the fused shards. Numerics follow transformers (RMSNorm in float32, RoPE
cos/sin in float32 then cast), so float32 logits match it to ~1e-5.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from spec_runtime.model.attention import AttentionBackend
from spec_runtime.model.forward_batch import ForwardBatch
from spec_runtime.model.hf_config import ModelArch
from spec_runtime.model.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """[D/2] float32 inverse frequencies, llama3 scaling applied when configured."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    s = arch.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D] (half-split layout, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size,
                                  bias=arch.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_proj_bias, dtype=dtype)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend, kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v, kv, batch)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend, kv: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, backend, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF name suffix -> (our parameter suffix, shard id) for the fused projections.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied or not).

    Build it under `torch.device("meta")` and `to_empty` it to avoid initialising
    weights that are about to be overwritten; call `init_rope()` after that, and
    `bind(backend, kv)` before the first forward.
    """

    def __init__(self, arch: ModelArch, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, dtype) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(
            arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype
        )
        # Plain attributes, not buffers: `to_empty` would wipe buffers.
        self.inv_freq: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.kv_cache: KVCache | None = None
        # CUDA one-token forwards use triton_linear's projections (cuda_ops.pick_small_linear decides).
        self.small_linear = False

    def init_rope(self) -> None:
        self.inv_freq = rope_inv_freq(self.arch).to(self.embed_tokens.weight.device)  # [D/2] fp32

    def bind(self, backend: AttentionBackend, kv: KVCache) -> None:
        if kv.num_layers != self.arch.num_layers or kv.num_kv_heads != self.arch.num_kv_heads \
                or kv.head_dim != self.arch.head_dim:
            raise ValueError(f"{kv} does not fit the model {self.arch}")
        self.backend = backend
        self.kv_cache = kv

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden [T, H]. The caller has run backend.begin(batch)."""
        if self.backend is None or self.kv_cache is None or self.inv_freq is None:
            raise ValueError("call init_rope() and bind(backend, kv) before forward")
        x = self.embed_tokens(input_ids)  # [T, H]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch, self.backend, self.kv_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to our dtype/device); raise on unknown or missing ones."""
        params = dict(self.named_parameters())
        expected: set[tuple[str, object]] = set()
        for name, p in params.items():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                expected.update((name, s) for s in ("q", "k", "v"))
            elif name.endswith("gate_up_proj.weight"):
                expected.update((name, s) for s in (0, 1))
            else:
                expected.add((name, None))
        a = self.arch
        qkv_offsets = {"q": (0, a.q_size), "k": (a.q_size, a.kv_size), "v": (a.q_size + a.kv_size, a.kv_size)}
        loaded: set[tuple[str, object]] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            shard = None
            for hf_part, (ours, shard_id) in _FUSED.items():
                if f".{hf_part}." in name:
                    name, shard = name.replace(hf_part, ours), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            if shard is None:
                dst = param
            elif shard in qkv_offsets:
                off, size = qkv_offsets[shard]
                dst = param.narrow(0, off, size)
            else:
                dst = param.narrow(0, shard * a.intermediate_size, a.intermediate_size)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
