"""The architecture of a checkpoint of a supported family, parsed once from its HF config.

`ModelArch` is the only description of a model the rest of the package reads: it
accepts a transformers `PretrainedConfig` or a plain config.json dict, in either the
transformers 5 form (`rope_parameters`) or the older one (`rope_theta` + `rope_scaling`).
Anything the model code cannot run faithfully (a model type the registry lacks,
per-layer window patterns, an unsupported RoPE scaling) is refused here with a
ValueError, not silently approximated later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spec_runtime.models.registry import SUPPORTED_MODEL_TYPES

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE interpolation (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    tie_word_embeddings: bool
    # Bias on q/k/v (Qwen2 always; Llama/Qwen3 when attention_bias is set).
    attention_bias: bool
    # Bias on o_proj: Llama/Qwen3 tie it to attention_bias, Qwen2 never has one.
    o_proj_bias: bool
    # Per-head RMSNorm on q and k before RoPE (Qwen3).
    qk_norm: bool
    max_position_embeddings: int
    # eos_token_id of the config, as a tuple (configs give an int, a list or nothing).
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention (Mistral): a token sees itself and the sliding_window - 1
    # tokens before it. None: full causal attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise ValueError(f"expected a PretrainedConfig or a config dict, got {type(config).__name__}")
    return to_dict()


def _rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either config form."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type form; only full attention is supported
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return float(theta), None
    try:
        llama3 = Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 RoPE scaling is missing {e.args[0]!r}") from None
    if llama3.high_freq_factor <= llama3.low_freq_factor:
        raise ValueError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor")
    return float(theta), llama3


def arch_from_config(config: Any) -> ModelArch:
    """Parse a transformers PretrainedConfig or a config.json dict into a ModelArch."""
    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only the SiLU MLP is supported, config has hidden_act={act!r}")
    if cfg.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if cfg.get("use_sliding_window", False):
        # Qwen2/Qwen3: a window on the layers past max_window_layers only.
        raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full-attention layers are supported, got layer_types={layer_types}")

    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    theta, scaling = _rope(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (
        (int(eos),) if eos is not None else ()
    )
    return ModelArch(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else attention_bias,
        o_proj_bias=False if model_type == "qwen2" else attention_bias,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        sliding_window=_sliding_window(cfg),
    )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window of a family whose every layer slides (Mistral); None elsewhere. Qwen2
    and Qwen3 configs carry a sliding_window that applies only with use_sliding_window
    (default off, refused above)."""
    if cfg.get("model_type") in ("qwen2", "qwen3") or cfg.get("sliding_window") is None:
        return None
    return int(cfg["sliding_window"])


def load_arch(model_dir: str) -> ModelArch:
    """ModelArch of a Hugging Face directory's config.json."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    with open(path) as f:
        return arch_from_config(json.load(f))
