"""SSD end to end: greedy output equals AR exactly, with cache hits and misses both
exercised, at batch 1 and 4, for each backup speculator."""

from __future__ import annotations

import pytest

from e2e_util import first_tokens, homogeneity_pvalue, make_config, random_prompts
from protocol.messages import SamplingParams
from spec_runtime.client import Client

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_pair, ar_reference):
    target, draft = tiny_pair
    prompts = random_prompts(384)
    return target, draft, prompts, ar_reference(target, prompts, GREEDY.max_tokens)


# jit at K=3 is the quick check; the other backups and K=8 take minutes on a small CPU.
@pytest.mark.parametrize("backup,k", [("jit", 3), pytest.param("jit", 8, marks=pytest.mark.slow),
                                      pytest.param("ngram", 3, marks=pytest.mark.slow),
                                      pytest.param("none", 3, marks=pytest.mark.slow)])
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
    # A step's loop iteration holds its admission, the wait for the draft and the verify.
    assert stats.num_steps > 0 and stats.admit_s > 0
    assert stats.loop_s >= stats.verify_s + stats.draft_wait_s + stats.admit_s > 0


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


# Temperature 1 with top_k 8 keeps the support small enough for a chi-square test.
SAMPLED = dict(max_tokens=8, temperature=1.0, top_k=8, ignore_eos=True)
NUM_SAMPLED = 1500


@pytest.fixture(scope="module")
def ar_samples(models):
    """The 8 tokens of NUM_SAMPLED seeded requests (SAMPLED) in AR mode."""
    target, _, prompts, _ = models
    with Client(make_config(target, mode="ar", max_batch_size=32)) as client:
        return first_tokens(client, prompts[0], NUM_SAMPLED, 0, SAMPLED)


def _same_distribution(ar, other) -> None:
    for pos in range(8):
        p = homogeneity_pvalue([t[pos] for t in ar], [t[pos] for t in other])
        assert p > 0.001, (pos, p)
    for pair in ((1, 3), (4, 6), (6, 8)):
        p = homogeneity_pvalue([t[slice(*pair)] for t in ar], [t[slice(*pair)] for t in other])
        assert p > 0.001, (pair, p)


@pytest.mark.slow
def test_ssd_sampling_distribution_matches_ar(models, ar_samples):
    """Exact at temperature 1 with the tree cache in the path: the 8 tokens of 1,500
    seeded requests follow the same distribution in SSD mode (most verify rounds
    answered from the cache, with rejections and recovery tokens) as in AR mode."""
    target, _, prompts, _ = models
    # Token 1 comes from prefill, the rest from verify rounds: the first of them usually
    # misses (continuous batching leaves the draft no idle moment to prefetch), later
    # ones are answered from the cache.
    # The draft is the target sampled at temperature 0.6 (q != p, so rejections and
    # recovery tokens happen, and both rank tokens alike); eight branches per depth and
    # a budget that grants them at batch 32 keep most outcomes (the target samples
    # from 8 tokens) in the cache.
    cfg = make_config(target, target, mode="ssd", k=2, max_batch_size=32, draft_temperature=0.6,
                      fan_out=(8, 8, 8), tree_budget=32 * 24)
    with Client(cfg) as client:
        ssd = first_tokens(client, prompts[0], NUM_SAMPLED, 10**6, SAMPLED)
        totals = client.engine_stats().totals
    assert totals.num_cache_hits > totals.num_cache_misses > 0, totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    _same_distribution(ar_samples, ssd)


def test_halves_sampling_distribution_matches_ar(models, ar_samples):
    """Exact at temperature 1 with halves steps (--work-ahead halves): each half
    verifies chains the draft made while the other half verified."""
    target, _, prompts, _ = models
    cfg = make_config(target, target, mode="ssd", k=2, max_batch_size=32, draft_temperature=0.6,
                      work_ahead="halves")
    with Client(cfg) as client:
        halves = first_tokens(client, prompts[0], NUM_SAMPLED, 2 * 10**6, SAMPLED)
        stats = client.engine_stats()
    assert stats.num_halves_steps > 0 and stats.num_ssd_rounds == stats.num_sd_rounds == 0
    assert 0 < stats.totals.num_accepted_tokens < stats.totals.num_draft_tokens
    _same_distribution(ar_samples, halves)
