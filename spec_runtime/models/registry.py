"""Model families by HF `model_type`: the module and class that run each.

Adding a family is one file in spec_runtime/models/ and one line here. Modules are
imported when a model of theirs is built, so this file imports nothing of the package.
"""

from __future__ import annotations

import importlib

# model_type -> (module in spec_runtime.models, class)
_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
}

SUPPORTED_MODEL_TYPES = tuple(_MODELS)


def model_class(model_type: str) -> type:
    """The nn.Module class that runs `model_type`; ValueError for an unknown one."""
    if model_type not in _MODELS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    module, cls = _MODELS[model_type]
    return getattr(importlib.import_module(f"spec_runtime.models.{module}"), cls)


def build_model(arch, device, dtype, tp_size: int = 1, tp_rank: int = 0):
    """The registered model for `arch` (a ModelArch) on `device` (rank tp_rank's shard of
    tp_size), its weights uninitialised (the loader or a benchmark fills them), RoPE
    tables ready, in eval mode."""
    import torch

    # Meta first, so no memory is spent initialising weights that are about to be overwritten.
    with torch.device("meta"):
        model = model_class(arch.model_type)(arch, dtype, tp_size=tp_size, tp_rank=tp_rank)
    model.to_empty(device=device)
    model.init_rope()
    return model.eval().requires_grad_(False)
