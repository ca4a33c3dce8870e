"""The draft's architecture: the target's family and vocabulary, fewer and narrower layers.

The default shape has about a tenth of the target's parameters: depth a tenth of the
target's (at least one layer), then the width (a multiple of the target's head size)
whose parameter count comes closest to that tenth. The LM head is tied to the
embeddings, which start as the target's embeddings projected onto their top principal
directions (all of them when the width is the target's), so the draft's first logits
already rank tokens the way the target's embedding geometry does.
"""

from __future__ import annotations

import copy
import logging

import torch

logger = logging.getLogger(__name__)

TARGET_FRACTION = 0.1


def count_params(model: torch.nn.Module) -> int:
    """Parameters, a tied embedding counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _round_ffn(width: int, cfg) -> int:
    ratio = cfg.intermediate_size / cfg.hidden_size
    return max(16, int(round(width * ratio / 16)) * 16)


def _heads(width: int, cfg) -> tuple[int, int]:
    head_dim = _head_dim(cfg)
    if width % head_dim:
        raise ValueError(f"hidden_size {width} must be a multiple of the target's head size {head_dim}")
    heads = width // head_dim
    group = max(1, cfg.num_attention_heads // cfg.num_key_value_heads)
    kv = max(1, heads // group)
    while heads % kv:
        kv -= 1
    return heads, kv


def estimate_params(cfg, num_layers: int, width: int, ffn: int) -> int:
    heads, kv = _heads(width, cfg)
    head_dim = _head_dim(cfg)
    attn = width * heads * head_dim * 2 + width * kv * head_dim * 2
    mlp = 3 * width * ffn
    return cfg.vocab_size * width + num_layers * (attn + mlp + 2 * width) + width


def draft_config(target_cfg, target_params: int, num_layers: int = 0, hidden_size: int = 0,
                 intermediate_size: int = 0):
    """A config of the target's class for the draft; 0 for a dimension picks the default."""
    layers = num_layers or max(1, round(target_cfg.num_hidden_layers * TARGET_FRACTION))
    head_dim = _head_dim(target_cfg)
    if hidden_size:
        width = hidden_size
    else:
        goal = TARGET_FRACTION * target_params
        widths = range(head_dim, target_cfg.hidden_size + 1, head_dim)
        width = min(widths, key=lambda w: abs(estimate_params(target_cfg, layers, w, _round_ffn(w, target_cfg)) - goal))
    if width > target_cfg.hidden_size:
        raise ValueError(f"hidden_size {width} is wider than the target's ({target_cfg.hidden_size})")
    heads, kv = _heads(width, target_cfg)
    cfg = copy.deepcopy(target_cfg)
    cfg.num_hidden_layers = layers
    cfg.hidden_size = width
    cfg.intermediate_size = intermediate_size or _round_ffn(width, target_cfg)
    cfg.num_attention_heads = heads
    cfg.num_key_value_heads = kv
    cfg.head_dim = head_dim
    cfg.tie_word_embeddings = True
    for name in ("layer_types", "max_window_layers"):  # per-layer lists sized for the target
        if hasattr(cfg, name) and isinstance(getattr(cfg, name), list):
            setattr(cfg, name, getattr(cfg, name)[:layers])
    # The draft is written unquantized under its own name, whatever file the target came from.
    for name in ("quantization_config", "_name_or_path"):
        if hasattr(cfg, name):
            delattr(cfg, name)
    return cfg


@torch.no_grad()
def init_from_target(draft: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy the target's embeddings into the draft, projected to its width (PCA) when narrower."""
    emb = target.get_input_embeddings().weight.detach().float().cpu()  # [vocab, target_width]
    width = draft.get_input_embeddings().weight.shape[1]
    if width < emb.shape[1]:
        centered = emb - emb.mean(0, keepdim=True)
        # Principal directions from the [width, width] covariance: cheap even for 128k vocabularies.
        _, vecs = torch.linalg.eigh(centered.T @ centered)
        basis = vecs[:, -width:].flip(1)  # [target_width, width], largest variance first
        emb = emb @ basis
        kept = (centered @ basis).pow(2).sum() / centered.pow(2).sum()
        logger.info("draft embeddings: target's projected to %d of %d dims (%.0f%% of their variance)",
                    width, basis.shape[0], 100 * kept.item())
    draft_emb = draft.get_input_embeddings().weight
    draft_emb.copy_(emb.to(draft_emb.dtype))
    if draft.get_output_embeddings() is not None and draft.get_output_embeddings().weight is not draft_emb:
        draft.get_output_embeddings().weight.copy_(emb.to(draft_emb.dtype))
    # Scale the final norm so the first logits have a spread of about 1: with a unit norm
    # they would be ~sqrt(width) * rms(embedding) wide and the first steps would be spent
    # shrinking them.
    draft.model.norm.weight.fill_(1.0 / (width ** 0.5 * emb.pow(2).mean().sqrt().item()))
