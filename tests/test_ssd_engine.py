"""SSD engine against the chain drafter.

A cached branch for outcome (j, t) must be what the draft would produce by drafting K
tokens from scratch after that outcome: the same tokens and the same q. That checks
the branch attention (a branch sees its slot's prefix up to its fork point and its own
scratch rows, nothing else) and the premise of exactness under sampling (the q stored
with a branch is the distribution its tokens were sampled from).
"""

from __future__ import annotations


import numpy as np
import pytest

from conftest import save_tiny_model
from draft_proc.drafter import ModelDrafter
from draft_proc.ssd import SSDEngine
from draft_proc.state import DraftSeq
from draft_proc.tree_budget import scratch_rows_needed
from spec_runtime.config import ModelConfig, SpeculativeConfig
from spec_runtime.engine.runner import ModelRunner

K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("ssd") / "m", "llama")


def _engine(model_dir, spec):
    runner = ModelRunner(ModelConfig(path=model_dir), num_slots=2, max_model_len=128,
                         num_scratch_rows=scratch_rows_needed(spec, 2))
    drafter = ModelDrafter(runner, spec)
    return SSDEngine(drafter, drafter, spec), drafter


def _seqs(temperature):
    rng = np.random.default_rng(0)
    return [DraftSeq(i, i, rng.integers(3, 384, size=n).tolist(), temperature=temperature, seed=100 + i)
            for i, n in enumerate((7, 12))]


@pytest.mark.parametrize("temperature,saguaro", [(0.0, None), (0.8, None), (0.8, 0.5)])
def test_cached_branches_equal_fresh_chain_drafts(model_dir, temperature, saguaro):
    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(3, 2, 2, 1), draft_top_k=16, saguaro_rescale=saguaro)
    engine, _ = _engine(model_dir, spec)
    _, reference = _engine(model_dir, spec)  # a second runner with its own, fresh KV
    seqs = _seqs(temperature)
    for s in seqs:  # the first outcome of a new sequence: (0, its first token)
        engine.note_outcome(s, 0, 5)
        s.apply_outcome(0, 5, s.num_tokens + 1, 1)
    prop, _ = engine.propose(seqs, K)
    assert not any(p.cache_hit for p in prop)  # nothing cached yet: the jit backup answered
    engine.work_ahead(seqs, K)
    assert engine.num_entries() == 2 * sum(spec.fan_out)

    checked = 0
    for b, s in enumerate(seqs):
        d = prop[b].draft_token_ids.tolist()
        assert len(d) == K
        for (j, t), entry in engine.cache.entries(s.seq_id).items():
            assert j == K or t != d[j]  # fork exclusion
            fresh = DraftSeq(9, 0, s.token_ids + d[:j] + [t], temperature=temperature, seed=s.seed)
            ref = reference.propose([fresh], K)
            assert entry.draft_token_ids.tolist() == ref[0].draft_token_ids.tolist()
            if temperature > 0:
                if saguaro is not None:
                    # The top F_i of each q were scaled down: q is no longer sorted there.
                    assert not np.all(np.diff(entry.q_probs, axis=-1) <= 1e-7)
                np.testing.assert_array_equal(entry.q_token_ids, ref[0].q_token_ids)
                np.testing.assert_allclose(entry.q_probs, ref[0].q_probs, atol=1e-5)
            checked += 1
    assert checked == 2 * sum(spec.fan_out)


def test_hit_returns_the_cached_speculation(model_dir):
    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(2, 1, 1, 1))
    engine, _ = _engine(model_dir, spec)
    seqs = _seqs(0.0)
    for s in seqs:
        engine.note_outcome(s, 0, 5)
        s.apply_outcome(0, 5, s.num_tokens + 1, 1)
    prop, _ = engine.propose(seqs, K)
    engine.work_ahead(seqs, K)
    # Outcome: sequence 0 rejects at depth 1 with a forked token (hit), sequence 1
    # gets a token nobody forked (miss).
    s0, s1 = seqs
    want_entries = engine.cache.entries(0)
    (j0, t0), want = next(((key, e) for key, e in want_entries.items() if key[0] == 1))
    unforked = next(t for t in range(3, 384) if engine.cache.lookup(1, 0, t) is None and t != prop[1].draft_token_ids[0])
    engine.note_outcome(s0, j0, t0)
    s0.apply_outcome(j0, t0, s0.num_tokens + j0 + 1, 2)
    engine.note_outcome(s1, 0, unforked)
    s1.apply_outcome(0, unforked, s1.num_tokens + 1, 2)
    prop2, by_depth = engine.propose(seqs, K)
    assert [p.cache_hit for p in prop2] == [True, False]
    # Each branch carries its fork's rank (a smaller tree holds the lower ranks); a miss none.
    ranks = sorted(e.hit_rank for e in want_entries.values())
    assert ranks == list(range(len(want_entries))) and prop2[0].hit_rank == want.hit_rank and prop2[1].hit_rank == -1
    assert by_depth[1] == 1 and sum(by_depth) == 1
    assert prop2[0].draft_token_ids.tolist() == want.draft_token_ids.tolist()
    assert engine.num_hits == 1 and engine.num_misses == 3
    engine.release(s0)
    assert engine.cache.lookup(0, j0, t0) is None


def test_a_round_without_work_ahead_feeds_the_hits_branch(model_dir):
    """After a hit, a round without work-ahead (an SD round) feeds the branch's tokens
    into the sequence's own rows, so the next chain takes in only the outcome (two
    tokens, as in SD mode, not the whole branch); that chain equals one drafted from
    scratch."""
    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(2, 1, 1, 1))
    engine, drafter = _engine(model_dir, spec)
    _, reference = _engine(model_dir, spec)
    seqs = _seqs(0.0)[:1]
    s = seqs[0]
    engine.note_outcome(s, 0, 5)
    s.apply_outcome(0, 5, s.num_tokens + 1, 1)
    engine.propose(seqs, K)
    engine.work_ahead(seqs, K)
    (j, t) = next(key for key in engine.cache.entries(0) if key[0] == 1)
    engine.note_outcome(s, j, t)
    s.apply_outcome(j, t, s.num_tokens + j + 1, 2)
    prop, _ = engine.propose(seqs, K)
    assert prop[0].cache_hit and s.num_cached == s.num_tokens - 1
    engine.skip_work_ahead(seqs)
    assert s.num_cached == s.num_tokens + K and engine.num_entries() == 0
    d = prop[0].draft_token_ids.tolist()
    engine.note_outcome(s, 2, 7)
    s.apply_outcome(2, 7, s.num_tokens + 3, 3)
    assert [len(item.token_ids) for item in drafter.catch_up_items(seqs)] == [2]  # t and the token before it
    chain, _ = engine.propose(seqs, K, count_misses=False)
    fresh = DraftSeq(9, 0, s.token_ids, temperature=0.0, seed=s.seed)
    assert s.token_ids[-3:] == d[:2] + [7]
    assert chain[0].draft_token_ids.tolist() == reference.propose([fresh], K)[0].draft_token_ids.tolist()


def test_chain_drafter_with_the_oracle_drafts_its_top_slot(model_dir):
    """With the benchmark oracle, a greedy chain's token at position p is the oracle's
    top slot at (seed, p): the per-step oracle the drafter precomputes is wired to the
    right step and position."""
    import torch

    from spec_runtime.bench.oracle import draft_oracle, draft_oracle_slots

    spec = SpeculativeConfig(mode="sd", k=K, synthetic_acceptance=(0.8, 0.5, 0.2, 0.1))
    runner = ModelRunner(ModelConfig(path=model_dir), num_slots=2, max_model_len=128)
    drafter = ModelDrafter(runner, spec, logits_transform=draft_oracle(spec.synthetic_acceptance))
    seqs = _seqs(0.0)
    prop = drafter.propose(seqs, K)
    for b, s in enumerate(seqs):
        pos = torch.arange(s.num_tokens, s.num_tokens + K)
        top, _ = draft_oracle_slots(torch.full((K,), s.seed), pos, runner.vocab_size, 0.8, (0.5, 0.2, 0.1))
        assert prop[b].draft_token_ids.tolist() == top[:, 0].tolist()
