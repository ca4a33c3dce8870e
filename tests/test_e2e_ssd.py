"""SSD end to end: greedy output equals AR exactly, with cache hits and misses both
exercised, at batch 1 and 4, for each backup speculator."""

from __future__ import annotations

import pytest

from conftest import save_tiny_model
from e2e_util import make_config, perturbed_copy, random_prompts
from protocol.messages import SamplingParams
from spec_runtime.client import Client

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssd-e2e")
    target = save_tiny_model(root / "target", "llama")
    draft = perturbed_copy(target, str(root / "draft"), noise=0.2)
    prompts = random_prompts(384)
    with Client(make_config(target, mode="ar")) as client:
        ar = [r.token_ids for r in client.generate_batch(prompts, GREEDY)]
    return target, draft, prompts, ar


@pytest.mark.parametrize("backup,k", [("jit", 3), ("jit", 8), ("ngram", 3), ("none", 3)])
def test_ssd_greedy_equals_ar(models, backup, k):
    target, draft, prompts, ar = models
    cfg = make_config(target, draft, mode="ssd", k=k, backup=backup)
    with Client(cfg) as client:
        batch = client.generate_batch(prompts, GREEDY)
        single = client.generate(prompts[1], GREEDY)
        stats = client.engine_stats()
    assert [r.token_ids for r in batch] == ar
    assert single.token_ids == ar[1]
    hits = sum(r.stats.num_cache_hits for r in batch)
    misses = sum(r.stats.num_cache_misses for r in batch)
    assert hits > 0 and misses > 0, (hits, misses)
    assert stats.totals.num_cache_hits == hits + single.stats.num_cache_hits
    assert sum(stats.hits_by_depth) == stats.totals.num_cache_hits and len(stats.hits_by_depth) == k + 1
    assert stats.num_running == 0


def test_ssd_with_draft_equal_to_target_mostly_hits(models):
    target, _, prompts, ar = models
    with Client(make_config(target, target, mode="ssd", k=3)) as client:
        batch = client.generate_batch(prompts, GREEDY)
    assert [r.token_ids for r in batch] == ar
    for r in batch:
        # Every outcome is a bonus token at depth K, which the draft forks first: only
        # the first look-up of each sequence can miss (the prefetch may catch it too).
        assert r.stats.num_cache_misses <= 1
        assert r.stats.num_accepted_tokens == r.stats.num_draft_tokens
