"""SmolLM2-135M-Instruct (the real GGUF) end to end.

Greedy: SD (n-gram draft) and SSD (SmolLM2 drafting for itself) give exactly AR's
tokens, and AR gives exactly transformers' generate. Sampling: SD's first tokens have
AR's distribution (a two-sample chi-square test over 1,500 requests each), and a seed
fixes the output at batch 1 and 4.
"""

from __future__ import annotations

import pytest

from e2e_util import first_tokens, hf_greedy, homogeneity_pvalue
from protocol.messages import SamplingParams
from spec_runtime.client import Client
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "List three uses of a paperclip.",
]
NEW_TOKENS = 64


def _cfg(gguf, mode, draft="", k=3, batch=4, max_model_len=512, **spec):
    return RuntimeConfig(
        target=ModelConfig(path=gguf), draft=ModelConfig(path=draft),
        spec=SpeculativeConfig(mode=mode, k=k, draft_timeout_s=60.0, **spec),
        sched=SchedulerConfig(max_batch_size=batch, max_model_len=max_model_len, spec_policy="always"), startup_timeout_s=300.0,
    )


@pytest.fixture(scope="module")
def greedy_ar(smollm2_gguf_path):
    with Client(_cfg(smollm2_gguf_path, "ar")) as client:
        prompts = [client.encode_prompt(p, chat=True) for p in PROMPTS]
        sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        ar = [r.token_ids for r in client.generate_batch(prompts, sp)]
        text = client.generate(prompts[0], SamplingParams(max_tokens=NEW_TOKENS)).text
    return prompts, ar, text


def test_ar_matches_transformers_and_reads_well(smollm2_gguf_path, greedy_ar):
    import os

    prompts, ar, text = greedy_ar
    directory, name = os.path.split(smollm2_gguf_path)
    assert ar == hf_greedy(directory, prompts, NEW_TOKENS, gguf_file=name)
    assert "Paris" in text


def test_sd_ngram_greedy_equals_ar(smollm2_gguf_path, greedy_ar):
    prompts, ar, _ = greedy_ar
    with Client(_cfg(smollm2_gguf_path, "sd", "ngram", k=8)) as client:
        batch = client.generate_batch(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        single = client.generate(prompts[2], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in batch] == ar
    assert single.token_ids == ar[2]


def test_ssd_greedy_equals_ar(smollm2_gguf_path, greedy_ar):
    prompts, ar, _ = greedy_ar
    # No prefetch: with the draft equal to the target every look-up after it would hit,
    # and this test wants misses (the backup path) as well as hits.
    with Client(_cfg(smollm2_gguf_path, "ssd", smollm2_gguf_path, k=3, ssd_prefetch=False)) as client:
        batch = client.generate_batch(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in batch] == ar
    assert sum(r.stats.num_cache_hits for r in batch) > 0
    assert sum(r.stats.num_cache_misses for r in batch) > 0


def test_sd_sampling_distribution_matches_ar(smollm2_gguf_path):
    # 1,500 requests per side: with the acceptance test mutated to u * q * 0.8 < p (too
    # many acceptances), position 1's p-value was 2e-5 at this size.
    n = 1500
    # Token 1 comes from prefill; tokens 2..3 from verify rounds. The target never
    # verifies past max_tokens, so the first round drafts one token (accepted, or
    # rejected with a recovery token) and an accepted one earns a bonus token.
    sp_kw = dict(max_tokens=3, temperature=1.0, top_k=20, ignore_eos=True)
    # Batch 96: on the 2-core CI host 384 SD requests took 20.9 s at batch 96 against
    # 34.6 s at 32; 64 positions fit the short prompt.
    with Client(_cfg(smollm2_gguf_path, "ar", batch=96, max_model_len=64)) as client:
        # A short raw prompt keeps the prefills cheap; the test is about decoding.
        prompt = client.encode_prompt("Once upon a time")
        ar = first_tokens(client, prompt, n, 0, sp_kw)
    # The draft is the same model at temperature 0.6: q != p, so rejections and
    # recovery tokens happen; the output must still follow p.
    with Client(_cfg(smollm2_gguf_path, "sd", smollm2_gguf_path, k=2, batch=96, max_model_len=64,
                     draft_temperature=0.6)) as client:
        sd = first_tokens(client, prompt, n, 10**6, sp_kw)
        totals = client.engine_stats().totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    for pos in range(3):
        p = homogeneity_pvalue([t[pos] for t in ar], [t[pos] for t in sd])
        assert p > 0.001, (pos, p)
    assert homogeneity_pvalue([t[1:3] for t in ar], [t[1:3] for t in sd]) > 0.001


def test_seed_fixes_output_at_batch_1_and_4(smollm2_gguf_path):
    with Client(_cfg(smollm2_gguf_path, "sd", "ngram", k=3)) as client:
        prompt = client.encode_prompt("Tell me a story about a cat.", chat=True)
        sp = SamplingParams(max_tokens=8, temperature=0.9, seed=1234)
        first = client.generate(prompt, sp).token_ids
        for _ in range(20):
            assert client.generate(prompt, sp).token_ids == first
        others = [SamplingParams(max_tokens=8, temperature=0.9, seed=s) for s in (1, 2, 3)]
        for _ in range(20):
            rids = [client.submit(prompt, sp)] + [client.submit(prompt, o) for o in others]
            assert client._collect(rids[0]).token_ids == first
            for r in rids[1:]:
                client._collect(r)
