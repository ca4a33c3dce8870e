"""Real-size models with random bf16 weights, built directly on the GPU (benchmarks only).

Benchmarks time the real architectures without their checkpoints. `BENCH_ARCHS`
holds the shapes of docs/benchmarks.md (Llama 3.1 8B, Qwen3 32B, Llama 3 70B, Llama 3.2
1B, Qwen3 0.6B) as ModelArch values; `random_model` allocates on the device (no host
copy) and fills the weights in place. The model loader reaches this module only for
a `random:<shape>` model name (`load_random_model`).
"""

from __future__ import annotations

import torch

import logging

from spec_runtime.models.hf_config import Llama3RopeScaling, ModelArch
from spec_runtime.models.registry import build_model

logger = logging.getLogger(__name__)

_LLAMA3_ROPE = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)


def _arch(model_type: str, hidden: int, layers: int, inter: int, heads: int, kv_heads: int, head_dim: int,
          vocab: int, theta: float, tied: bool, eps: float, rope: Llama3RopeScaling | None) -> ModelArch:
    return ModelArch(
        model_type=model_type, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, rms_norm_eps=eps, rope_theta=theta,
        rope_scaling=rope, tie_word_embeddings=tied, attention_bias=False, o_proj_bias=False,
        qk_norm=model_type == "qwen3", max_position_embeddings=32768,
    )


# Shapes of the HF configs of those models (tie_word_embeddings as in those configs).
BENCH_ARCHS: dict[str, ModelArch] = {
    "target-8b": _arch("llama", 4096, 32, 14336, 32, 8, 128, 128256, 500000.0, False, 1e-5, None),
    "target-32b": _arch("qwen3", 5120, 64, 25600, 64, 8, 128, 151936, 1000000.0, False, 1e-6, None),
    "target-70b": _arch("llama", 8192, 80, 28672, 64, 8, 128, 128256, 500000.0, False, 1e-5, None),
    "draft-1b": _arch("llama", 2048, 16, 8192, 32, 8, 64, 128256, 500000.0, True, 1e-5, _LLAMA3_ROPE),
    "draft-0.6b": _arch("qwen3", 1024, 28, 3072, 16, 8, 128, 151936, 1000000.0, True, 1e-6, None),
}


@torch.no_grad()
def random_model(arch: ModelArch, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, std: float = 0.02, tp_size: int = 1, tp_rank: int = 0) -> torch.nn.Module:
    """The registry's model of `arch` with N(0, std) matrices and norms near 1, on `device`.
    With tp_size > 1, rank tp_rank's shard: the whole tensors (embeddings, norms, LM
    head) are the same on every rank, the split ones drawn per rank (for speed only:
    the shards are not slices of the tp_size 1 model)."""
    model = build_model(arch, torch.device(device), dtype, tp_size, tp_rank)
    whole = torch.Generator(device=device)
    whole.manual_seed(seed)
    split = whole
    if tp_size > 1:
        split = torch.Generator(device=device)
        split.manual_seed(seed + 1 + tp_rank)
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        gen = split if getattr(owner, "split_dim", None) is not None and p.dim() == 2 else whole
        if "norm" in name:
            p.normal_(1.0, 0.05, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)
    return model


def load_random_model(name: str, device: torch.device, dtype: torch.dtype, tp_size: int = 1, tp_rank: int = 0):
    """(model, arch, tokenizer None) for the loader's `random:<name>`."""
    if name not in BENCH_ARCHS:
        raise ValueError(f"unknown random model shape {name!r}; choose from {', '.join(BENCH_ARCHS)}")
    arch = BENCH_ARCHS[name]
    logger.info("building %s with random weights on %s (benchmarks only: it has no tokenizer)", name, device)
    return random_model(arch, device, dtype, tp_size=tp_size, tp_rank=tp_rank), arch, None


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every weight but an untied embedding table (one row is read)."""
    total = weight_bytes(model)
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total
