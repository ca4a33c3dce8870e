"""Greedy speculative decoding end to end: two processes, real loading, real sockets.

SD output must equal AR output and transformers' greedy generate token for token, for
tiny random Llama and Qwen3 models, K in {1, 3, 8}, one prompt at a time and four
prompts of different lengths in flight together.
"""

from __future__ import annotations

import pytest

from conftest import save_tiny_pair
from e2e_util import hf_greedy, make_config, random_prompts
from protocol.messages import SamplingParams
from spec_runtime.client import Client

NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory, ar_reference):
    # Same weights plus noise: accepts often, rejects sometimes, so both paths run.
    target, draft = save_tiny_pair(tmp_path_factory.mktemp(request.param), request.param, noise=0.3)
    prompts = random_prompts(vocab=384)
    reference = hf_greedy(target, prompts, NEW_TOKENS)
    ar_batch = ar_reference(target, prompts, NEW_TOKENS)
    return {"target": target, "draft": draft, "prompts": prompts, "hf": reference, "ar": ar_batch}


def test_ar_matches_transformers(models):
    assert models["ar"] == models["hf"]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_sd_greedy_equals_ar(models, k):
    with Client(make_config(models["target"], models["draft"], mode="sd", k=k)) as client:
        batch = client.generate_batch(models["prompts"], GREEDY)
        single = [client.generate(p, GREEDY) for p in models["prompts"][:2]]
    assert [r.token_ids for r in batch] == models["ar"]
    assert [r.token_ids for r in single] == models["ar"][:2]
    drafted = sum(r.stats.num_draft_tokens for r in batch)
    accepted = sum(r.stats.num_accepted_tokens for r in batch)
    # The perturbed draft must exercise both acceptance and rejection.
    assert 0 < accepted < drafted
    for r in batch:
        assert r.stats.num_generated_tokens == NEW_TOKENS
        assert len(r.stats.accepted_per_position) == k


def test_draft_equal_to_target_accepts_everything(models):
    k = 3
    with Client(make_config(models["target"], models["target"], mode="sd", k=k)) as client:
        results = client.generate_batch(models["prompts"], GREEDY)
    for r in results:
        assert r.token_ids in models["ar"]
        # Verify rounds yield num_generated - 1 tokens (the first came from prefill); leave
        # out the final round, which max_tokens may cut short (it yields at most K + 1).
        verify_rounds = r.stats.num_rounds - 1
        tokens_before_final = r.stats.num_generated_tokens - 1 - (k + 1)
        assert tokens_before_final / (verify_rounds - 1) >= 0.98 * (k + 1)
        assert r.stats.num_accepted_tokens == r.stats.num_draft_tokens


def test_ngram_draft_greedy_equals_ar(models):
    with Client(make_config(models["target"], "ngram", mode="sd", k=3)) as client:
        results = client.generate_batch(models["prompts"], GREEDY)
    assert [r.token_ids for r in results] == models["ar"]
