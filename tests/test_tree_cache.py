"""Tree-cache bookkeeping: fork selection and exclusion, key look-up, budget, scratch rows."""

from __future__ import annotations

import numpy as np
import pytest

from draft_proc.tree_cache import TreeCache, select_forks
from protocol.sparse_q import DraftTokens


def _uniform_probs(ids):
    return np.full(ids.shape, 0.1)


def test_fork_excludes_the_draft_token_at_each_depth():
    ranked = np.array([[5, 7, 9, 11], [7, 5, 9, 11], [9, 8, 7, 6]])  # depths 0, 1, 2 (m = 2)
    draft = np.array([5, 9])
    forks = select_forks(0, ranked, _uniform_probs(ranked), draft, fan_out=(2, 2, 2), max_branches=10, accept_rate=0.5)
    got = [(f.depth, f.token_id) for f in forks]
    # depth 0 excludes d_1 = 5, depth 1 excludes d_2 = 9, depth 2 (bonus) excludes nothing.
    assert got == [(0, 7), (0, 9), (1, 7), (1, 5), (2, 9), (2, 8)]
    assert [f.branch for f in forks] == list(range(6))


def test_fork_budget_takes_the_likeliest_outcomes():
    ranked = np.tile(np.arange(10, 16), (4, 1))
    probs = np.tile([0.6, 0.2, 0.1, 0.05, 0.03, 0.02], (4, 1))
    draft = np.array([99, 99, 99])
    # Low acceptance: rejection at depth 0 dominates.
    low = select_forks(3, ranked, probs, draft, fan_out=(3, 2, 2, 1), max_branches=3, accept_rate=0.2)
    assert [(f.depth, f.token_id) for f in low] == [(0, 10), (0, 11), (1, 10)]
    # High acceptance: the bonus outcome (depth 3) is as likely as any rejection.
    high = select_forks(3, ranked, probs, draft, fan_out=(3, 2, 2, 1), max_branches=3, accept_rate=0.9)
    assert (3, 10) in [(f.depth, f.token_id) for f in high]
    assert [f.branch for f in high] == [0, 1, 2]


def test_fork_skips_depths_past_a_short_speculation():
    ranked = np.array([[4, 5, 6]])  # m = 0: only depth 0
    forks = select_forks(1, ranked, _uniform_probs(ranked), np.array([], dtype=np.int64), fan_out=(2, 2, 1),
                         max_branches=8, accept_rate=0.5)
    assert [(f.depth, f.token_id) for f in forks] == [(0, 4), (0, 5)]
    with pytest.raises(ValueError):
        select_forks(1, ranked, _uniform_probs(ranked), np.array([3]), fan_out=(1, 1), max_branches=8, accept_rate=0.5)


def test_lookup_replace_and_clear():
    cache = TreeCache(max_branches=3, k=2, scratch_base=1000)
    spec = DraftTokens(np.array([1, 2]))
    cache.replace(7, {(0, 4): spec, (1, 5): spec})
    assert cache.lookup(7, 0, 4) is spec
    assert cache.lookup(7, 1, 4) is None  # same token, other depth: a different outcome
    assert cache.lookup(8, 0, 4) is None
    assert cache.num_entries() == 2
    cache.replace(7, {(2, 6): spec})  # a new speculation invalidates the old branches
    assert cache.lookup(7, 0, 4) is None and cache.num_entries() == 1
    with pytest.raises(ValueError):
        cache.replace(7, {(0, i): spec for i in range(4)})  # over the budget
    cache.clear(7)
    assert cache.num_entries() == 0 and cache.num_seqs() == 0


def test_scratch_rows_are_disjoint_and_bounded():
    cache = TreeCache(max_branches=3, k=4, scratch_base=100)
    rows = [cache.scratch_rows(slot, b, 4) for slot in range(2) for b in range(3)]
    flat = np.concatenate(rows)
    assert len(set(flat.tolist())) == len(flat) == 2 * 3 * 4
    assert flat.min() == 100 and flat.max() == 100 + 24 - 1
    with pytest.raises(ValueError):
        cache.scratch_rows(0, 3, 1)
    with pytest.raises(ValueError):
        cache.scratch_rows(0, 0, 5)
