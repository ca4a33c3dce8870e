"""Tiny random models on disk, for tests and for runs on a small machine.

Each model goes through the real loading path: config.json, safetensors and tokenizer
files written with `save_pretrained`. The tokenizer is a small byte-level BPE trained
in memory with ChatML special tokens, so text round-trips without any download.

    from tiny_models import save_tiny_pair
    target, draft = save_tiny_pair("/tmp/tiny")

`save_tiny_model(path, model_type)` writes one model (llama, qwen2, qwen3);
`perturbed_copy(src, dst, noise)` writes a draft that agrees with its target often but
not always; `save_tiny_pair` does both. The tests import these through tests/conftest.py,
scripts/soak.py directly.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import NamedTuple

TINY_VOCAB_SIZE = 384
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Hello, world! What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "One two three four five six seven eight nine ten.",
] * 4


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE tokenizer of exactly TINY_VOCAB_SIZE tokens; ids 0,1,2 are the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


_BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    # Large init so logits are O(1) and a 1e-4 comparison means something.
    initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def save_tiny_model(path, model_type: str = "llama", seed: int = 0, **overrides) -> str:
    """Save a random tiny `model_type` (a transformers model type: llama, qwen2, qwen3, ...)
    with its tokenizer under `path`; `overrides` replace config fields."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(_BASE, vocab_size=len(tiny_tokenizer()))
    if model_type == "qwen3":
        kwargs["head_dim"] = 32  # != hidden / heads, as in real Qwen3
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # HF zero-inits biases and sets norms to 1; randomise them so they are tested.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def perturbed_copy(src: str, dst: str, noise: float, seed: int = 1) -> str:
    """A copy of the model at `src` whose weights get Gaussian noise of `noise` times each
    tensor's standard deviation: a draft that agrees with the target often but not always."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    path = os.path.join(dst, "model.safetensors")
    weights = load_file(path)
    for name, w in weights.items():
        weights[name] = w + noise * torch.randn(w.shape, generator=g) * w.std()
    save_file(weights, path, metadata={"format": "pt"})
    return dst


class TinyPair(NamedTuple):
    target: str
    draft: str


def save_tiny_pair(root, model_type: str = "llama", noise: float = 0.2, **overrides) -> TinyPair:
    """A tiny random target under root/target and its perturbed copy under root/draft.

    noise 0.2 makes the draft accept often and reject sometimes, so both paths of the
    verifier run; `overrides` go to the target's config (e.g. max_position_embeddings)."""
    target = save_tiny_model(os.path.join(str(root), "target"), model_type, **overrides)
    return TinyPair(target, perturbed_copy(target, os.path.join(str(root), "draft"), noise=noise))
