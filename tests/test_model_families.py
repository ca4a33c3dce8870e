"""Every registered model family, loaded from a tiny transformers checkpoint, against
transformers itself (float32, CPU): prefill, then decode steps over the KV pool.

Mistral runs with a sliding window shorter than the context, so both the prefill and
the decode steps past the window are checked against transformers' windowed mask.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import save_tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM, MistralConfig

from spec_runtime.attention import make_backend
from spec_runtime.config import ModelConfig
from spec_runtime.engine.forward_batch import ForwardItem, TreeBranch, build_tree_batch
from spec_runtime.engine.runner import ModelRunner
from spec_runtime.models.registry import SUPPORTED_MODEL_TYPES

ATOL = 1e-4
PROMPT, DECODE = 14, 6


def save_tiny_mistral(path, sliding_window: int | None, seed: int = 0) -> str:
    """A random tiny Mistral (head_dim != hidden / heads, as in Mistral Nemo) with its tokenizer."""
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                           initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           vocab_size=len(tiny_tokenizer()), sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF sets norms to 1; randomise them so they are tested
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


CASES = {
    # case: (model_type, how to save it)
    "llama": ("llama", lambda p: save_tiny_model(p, "llama")),
    "qwen2": ("qwen2", lambda p: save_tiny_model(p, "qwen2")),
    "qwen3": ("qwen3", lambda p: save_tiny_model(p, "qwen3")),
    "mistral-in-window": ("mistral", lambda p: save_tiny_mistral(p, sliding_window=64)),
    "mistral-past-window": ("mistral", lambda p: save_tiny_mistral(p, sliding_window=5)),
}


def test_every_registered_family_has_a_case() -> None:
    assert set(SUPPORTED_MODEL_TYPES) == {model_type for model_type, _ in CASES.values()}


@pytest.mark.parametrize("case", list(CASES))
def test_family_logits_match_transformers(case: str, tmp_path) -> None:
    model_type, save = CASES[case]
    path = save(tmp_path / case)
    runner = ModelRunner(ModelConfig(path=path), num_slots=1, max_model_len=64)
    assert runner.arch.model_type == model_type
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(3, runner.vocab_size, (PROMPT + DECODE,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()  # [PROMPT + DECODE, V]
    rows = runner.layout.slot_rows(0, PROMPT + DECODE)
    got = [runner.run([ForwardItem(toks[:PROMPT], 0, rows[:PROMPT], logits="all")])]
    for pos in range(PROMPT, PROMPT + DECODE):
        got.append(runner.run([ForwardItem(toks[pos:pos + 1], pos, rows[:pos + 1], logits="all")]))
    ours = torch.cat(got)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # The comparison can fail: logits are O(1) and differ between positions.
    assert (ref[1:] - ref[:-1]).abs().max() > 0.1


def test_the_window_changes_the_logits(tmp_path) -> None:
    """Past the window, Mistral's logits differ from the same weights without a window,
    so the windowed comparison above is not passed by full attention."""
    windowed = ModelRunner(ModelConfig(path=save_tiny_mistral(tmp_path / "w", sliding_window=5)),
                           num_slots=1, max_model_len=64)
    full = ModelRunner(ModelConfig(path=save_tiny_mistral(tmp_path / "f", sliding_window=None)),
                       num_slots=1, max_model_len=64)
    assert windowed.arch.sliding_window == 5 and full.arch.sliding_window is None
    toks = list(range(3, 3 + PROMPT))
    a, b = (r.run([ForwardItem(toks, 0, r.layout.slot_rows(0, PROMPT), logits="all")]) for r in (windowed, full))
    torch.testing.assert_close(a[:5], b[:5], atol=ATOL, rtol=0)  # within the window: the same
    assert (a[5:] - b[5:]).abs().max() > 1e-2  # past it: not


def test_windowed_models_refuse_what_they_cannot_run(tmp_path) -> None:
    with pytest.raises(ValueError, match="CPU only"):
        make_backend(4, 2, 32, torch.bfloat16, "cuda", sliding_window=5)
    runner = ModelRunner(ModelConfig(path=save_tiny_mistral(tmp_path / "m", sliding_window=5)),
                         num_slots=1, max_model_len=64, num_scratch_rows=8)
    runner.run([ForwardItem([3, 4, 5], 0, runner.layout.slot_rows(0, 3), logits="none")])
    scratch = runner.layout.scratch_base
    branch = TreeBranch(token_id=7, position=3, local_rows=np.array([scratch], dtype=np.int64), num_visible=1)
    tree = build_tree_batch([runner.layout.slot_rows(0, 3)], [[branch]], q_len=1, dummy_row=runner.dummy_row,
                            device="cpu")
    with pytest.raises(ValueError, match="sliding window"):
        runner.forward(tree)
