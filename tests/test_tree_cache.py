"""Tree-cache bookkeeping: fork selection and exclusion, key look-up, budget, scratch rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from draft_proc.tree_cache import BranchTable, TreeCache, select_forks, select_forks_batch, select_forks_groups
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


def _forks_by_definition(ids, probs, draft, fan_out, max_branches, accept_rate):
    """select_forks's doc, one candidate at a time: (depth, token) of the chosen forks."""
    m, a = len(draft), min(max(accept_rate, 1e-3), 1 - 1e-3)
    candidates = []
    for j in range(m + 1):
        want = fan_out[j] if j < len(fan_out) else 0
        row = [(int(t), float(p)) for t, p in zip(ids[j], probs[j])]
        if j < m:
            q_excluded = next((p for t, p in row if t == draft[j]), 0.0)
            scale, excluded = a**j * (1 - a) / max(1e-6, 1.0 - q_excluded), int(draft[j])
        else:
            scale, excluded = a**m, -1
        usable = [(t, p) for t, p in row if t != excluded and t >= 0][: max(want, 0)]
        candidates += [(scale * p, j, t) for t, p in usable]
    best = sorted(candidates, key=lambda c: (-c[0], c[1]))[:max_branches]
    return [(j, t) for _, j, t in sorted(best, key=lambda c: (c[1], -c[0]))]


@pytest.mark.parametrize("ties", [False, True])
def test_batched_fork_selection_is_the_definition_row_by_row(ties):
    rng = np.random.default_rng(3 if ties else 4)
    for _ in range(200):
        b, m, r = int(rng.integers(1, 6)), int(rng.integers(0, 5)), int(rng.integers(1, 7))
        ids = rng.integers(-1, 10, size=(b, m + 1, r))  # repeats and -1 padding included
        probs = (rng.choice([0.1, 0.2, 0.4], size=ids.shape) if ties else rng.random(ids.shape)).astype(np.float32)
        drafts = rng.integers(0, 10, size=(b, m))
        fan = tuple(int(f) for f in rng.integers(0, 4, size=int(rng.integers(0, m + 3))))
        budget, rate = int(rng.integers(1, 10)), float(rng.random())
        depth, token, count, rank = select_forks_batch(ids, probs, drafts, fan, budget, rate)
        for row in range(b):
            want = _forks_by_definition(ids[row], probs[row], drafts[row], fan, budget, rate)
            assert list(zip(depth[row, : count[row]].tolist(), token[row, : count[row]].tolist())) == want
            forks = select_forks(9, ids[row], probs[row], drafts[row], fan, budget, rate)
            assert [(f.depth, f.token_id) for f in forks] == want
            assert [f.branch for f in forks] == list(range(len(want)))
            assert [f.rank for f in forks] == rank[row, : count[row]].tolist()
            # A smaller budget forks exactly those of lower rank: a hit's rank says which trees it hits.
            for n in range(1, budget):
                smaller = select_forks(9, ids[row], probs[row], drafts[row], fan, n, rate)
                assert [(f.depth, f.token_id) for f in smaller] == [(f.depth, f.token_id) for f in forks if f.rank < n]


def test_fork_groups_come_back_sequence_by_sequence():
    """Sequences of two drafts counts, in groups above and below FORK_LOOP_SEQS: each
    sequence's forks are select_forks's, in sequence order, numbered from 0."""
    rng = np.random.default_rng(5)
    ms = [2, 0, 2, 2, 1, 2, 0, 2]
    seqs = [SimpleNamespace(draft_token_ids=rng.integers(0, 50, size=m).tolist()) for m in ms]
    ids = rng.integers(0, 50, size=(sum(m + 1 for m in ms), 6))
    probs = rng.random(ids.shape).astype(np.float32)
    starts = np.cumsum([0] + [m + 1 for m in ms[:-1]])
    groups = {}
    for i, m in enumerate(ms):
        groups.setdefault((m, (2, 2, 1)), []).append(i)
    assert sorted(len(g) for g in groups.values()) == [1, 2, 5]  # both paths
    forks = select_forks_groups(groups, seqs, (ids, probs, starts), 4, 0.7)
    want = []
    for i, m in enumerate(ms):
        rows = slice(starts[i], starts[i] + m + 1)
        want += [(i, f.depth, f.token_id, f.branch, f.rank) for f in
                 select_forks(i, ids[rows], probs[rows], np.array(seqs[i].draft_token_ids, dtype=np.int64), (2, 2, 1), 4, 0.7)]
    got = list(zip(forks.seq.tolist(), forks.depth.tolist(), forks.token_id.tolist(), forks.branch.tolist(),
                   forks.rank.tolist()))
    assert got == want and len(forks) == len(want)


def test_a_branch_table_answers_rows_of_its_arrays():
    tokens = np.arange(12).reshape(3, 4)
    q_ids, q_probs = np.arange(24).reshape(3, 4, 2), np.ones((3, 4, 2), dtype=np.float32)
    cache = TreeCache(max_branches=2, k=4, scratch_base=0)
    cache.replace_rows(1, {(0, 7): 2, (1, 8): 0},
                       BranchTable(tokens, q_ids, q_probs, np.array([4, 1, 3]), ranks=np.array([1, 2, 0])))
    got = cache.lookup(1, 0, 7)
    assert got.draft_token_ids.tolist() == [8, 9, 10] and got.q_token_ids.tolist() == q_ids[2, :3].tolist()
    assert got.hit_rank == 0 and cache.lookup(1, 1, 8).hit_rank == 1
    assert cache.lookup(1, 1, 8).draft_token_ids.tolist() == [0, 1, 2, 3] and cache.lookup(1, 1, 7) is None
    assert set(cache.entries(1)) == {(0, 7), (1, 8)} and cache.num_entries() == 2
    cache.replace_rows(2, {(0, 1): 1}, BranchTable(tokens, None, None, np.array([4, 2, 3])))
    assert cache.lookup(2, 0, 1).q_token_ids is None and cache.lookup(2, 0, 1).draft_token_ids.tolist() == [4, 5]
    assert cache.lookup(2, 0, 1).hit_rank == -1  # no ranks: unknown
    with pytest.raises(ValueError):
        cache.replace_rows(3, {(0, i): i for i in range(3)}, BranchTable(tokens, None, None, np.array([1, 1, 1])))
