"""Forks chosen on the device (draft_proc/device_forks.py) are the host's forks.

  - select_forks_device gives select_forks_batch's depths and tokens, entry for entry,
    with repeated ids, -1 padding and tied probabilities, and sequences of different
    drafts counts in one call;
  - DeviceForks lays a work-ahead's groups out sequence by sequence as
    select_forks_groups does, and `fits` says when a ranking fixes their number;
  - TreeLayout.batch_on_device patches the uploaded layout into `batch`'s step, and
    fill_host its host copies.

The engine's work-aheads through this path against the per-branch layout's:
tests/test_tree_layout.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from draft_proc.device_forks import DeviceForks, fits, ranking_width_needed, select_forks_device
from draft_proc.tree_cache import Forks, select_forks_batch, select_forks_groups
from draft_proc.tree_layout import TreeLayout, fork_count, fork_counts
from test_tree_cache import random_rankings

K = 3
DUMMY = 9999


@pytest.mark.parametrize("ties", [False, True])
def test_device_selection_is_select_forks_batch(ties):
    for ids, probs, drafts, fan, budget, rate in random_rankings(13 if ties else 14, ties):
        depth, token, _ = select_forks_batch(ids, probs, drafts, fan, budget, rate)
        b, m = drafts.shape
        want = np.tile([fan[j] if j < len(fan) else 0 for j in range(m + 1)], (b, 1))
        d, t = select_forks_device(torch.from_numpy(ids), torch.from_numpy(probs), torch.from_numpy(drafts),
                                   torch.full((b,), m), torch.from_numpy(want), budget, rate)
        np.testing.assert_array_equal(d.numpy(), depth)
        np.testing.assert_array_equal(t.numpy(), token)


def test_ranking_width_needed_is_the_narrowest_that_gives_fork_count():
    rng = np.random.default_rng(15)
    for _ in range(300):
        m = int(rng.integers(0, 5))
        fan = tuple(int(f) for f in rng.integers(0, 4, size=int(rng.integers(1, m + 3))))
        need, budget = ranking_width_needed(m, fan), 50
        for r, enough in ((need, True), (need - 1, False)):
            if r < 1:
                continue
            # The worst case: every depth's ranking holds its excluded draft token.
            ids = np.stack([rng.permutation(30)[:r] for _ in range(m + 1)])[None]
            drafts = ids[0, :m, 0][None].copy()
            probs = -np.sort(-rng.random(ids.shape), axis=2).astype(np.float32)
            _, _, count = select_forks_batch(ids, probs, drafts, fan, budget, 0.7)
            assert (count[0] == fork_count(m, fan, budget)) == enough, (m, fan, r)
            assert fits({(m, fan): [0]}, r) == enough


def _work_ahead(rng, ms, fans, per_seq, width):
    seqs = [SimpleNamespace(draft_token_ids=rng.choice(50, size=m, replace=False).tolist()) for m in ms]
    rows = sum(m + 1 for m in ms)
    ids = np.stack([rng.permutation(50)[:width] for _ in range(rows)])
    # The draft tokens are ranked too, where their exclusion shows.
    start = 0
    for s in seqs:
        for j, d in enumerate(s.draft_token_ids):
            if d not in ids[start + j]:
                ids[start + j, int(rng.integers(width))] = d
        start += len(s.draft_token_ids) + 1
    probs = -np.sort(-rng.random(ids.shape), axis=1).astype(np.float32)
    starts = np.cumsum([0] + [m + 1 for m in ms[:-1]]).astype(np.int64)
    groups = {}
    for i, (m, fan) in enumerate(zip(ms, fans)):
        groups.setdefault((m, fan if m else (per_seq,)), []).append(i)
    return seqs, ids, probs, starts, groups


def _layout(counts, rng):
    n = rng.integers(3, 30, size=len(counts))
    m = rng.integers(0, K + 1, size=len(counts))
    present = np.flatnonzero(counts)
    prefixes = [1000 * (i + 1) + np.arange(n[i]) for i in present]
    accepted = np.full((len(present), max(1, int(m[present].max()))), DUMMY)
    for r, i in enumerate(present):
        accepted[r, : m[i]] = 1000 * (i + 1) + n[i] + np.arange(m[i])
    seq_scratch = 50000 + 100 * np.arange(len(counts))
    return TreeLayout(prefixes, counts, n, accepted, seq_scratch, 10, K, int(counts.max()) + 1, DUMMY), m


def test_device_forks_are_the_host_forks_sequence_by_sequence():
    """Groups of several drafts counts and two fan-outs, a fresh sequence (m = 0, the
    whole budget at depth 0), groups of one sequence and of several: one selection for
    all of them."""
    rng = np.random.default_rng(16)
    for _ in range(40):
        per_seq = int(rng.integers(2, 9))
        ms = rng.integers(0, 4, size=int(rng.integers(1, 7))).tolist()
        fans = [((2, 2, 1, 1), (3, 1, 1, 1))[int(rng.integers(2))] for _ in ms]
        seqs, ids, probs, starts, groups = _work_ahead(rng, ms, fans, per_seq, width=max(4, per_seq))
        assert fits(groups, ids.shape[1])
        want = select_forks_groups(groups, seqs, (ids, probs, starts), per_seq, 0.6)
        counts = fork_counts(groups, len(seqs), per_seq)
        np.testing.assert_array_equal(np.bincount(want.seq, minlength=len(seqs)), counts)
        layout, _ = _layout(counts, rng)
        got = DeviceForks(groups, seqs, (torch.from_numpy(ids), torch.from_numpy(probs), starts), layout, per_seq,
                          0.6)
        host = got.host()
        for field in ("seq", "depth", "token_id", "branch"):
            np.testing.assert_array_equal(getattr(host, field), getattr(want, field))
        np.testing.assert_array_equal(got.depth.numpy(), want.depth)
        np.testing.assert_array_equal(got.token.numpy(), want.token_id)


def test_a_narrow_ranking_does_not_fit():
    rng = np.random.default_rng(17)
    seqs, ids, probs, starts, groups = _work_ahead(rng, [2, 3], [(3, 2, 2, 1)] * 2, 8, width=3)
    assert not fits(groups, ids.shape[1])  # depth 0 needs F_0 + 1 = 4 tokens


def test_the_step_patched_on_the_device_is_the_step_laid_out_on_the_host():
    rng = np.random.default_rng(18)
    for _ in range(50):
        counts = rng.integers(0, 4, size=int(rng.integers(1, 5)))
        counts[int(rng.integers(len(counts)))] = max(1, counts.max())
        seed = int(rng.integers(1 << 30))  # two equal layouts: `batch` writes into its host arrays
        got_layout, m = _layout(counts, np.random.default_rng(seed))
        want_layout, _ = _layout(counts, np.random.default_rng(seed))
        seq = got_layout.seq
        forks = Forks(seq=seq, depth=rng.integers(0, m[seq] + 1), token_id=rng.integers(0, 500, size=len(seq)),
                      branch=got_layout.branch)
        want = want_layout.batch(forks, "cpu")
        got = got_layout.batch_on_device(torch.from_numpy(forks.depth), torch.from_numpy(forks.token_id), "cpu")
        for field in ("input_ids", "positions", "kv_write_rows", "qo_indptr", "kv_indptr", "kv_indices",
                      "logits_indices"):
            np.testing.assert_array_equal(getattr(got, field).numpy(), getattr(want, field).numpy(), field)
        for field in ("prefix_len", "lo", "hi", "advance"):
            np.testing.assert_array_equal(getattr(got.tree, field).numpy(), getattr(want.tree, field).numpy(), field)
        got_layout.fill_host(forks)
        np.testing.assert_array_equal(got.logits_positions_cpu, want.logits_positions_cpu)
        np.testing.assert_array_equal(got.tree.hi_cpu, want.tree.hi_cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_device_forks_and_their_step_are_the_hosts():
    """The same checks with CUDA tensors: the choice, the read-back through pinned memory,
    and the patched step."""
    rng = np.random.default_rng(19)
    for _ in range(20):
        per_seq = int(rng.integers(2, 9))
        ms = rng.integers(0, 4, size=int(rng.integers(1, 7))).tolist()
        seqs, ids, probs, starts, groups = _work_ahead(rng, ms, [(2, 2, 1, 1)] * len(ms), per_seq, max(4, per_seq))
        want = select_forks_groups(groups, seqs, (ids, probs, starts), per_seq, 0.6)
        counts = fork_counts(groups, len(seqs), per_seq)
        seed = int(rng.integers(1 << 30))
        got_layout, _ = _layout(counts, np.random.default_rng(seed))
        want_layout, _ = _layout(counts, np.random.default_rng(seed))
        got = DeviceForks(groups, seqs, (torch.from_numpy(ids).cuda(), torch.from_numpy(probs).cuda(), starts),
                          got_layout, per_seq, 0.6)
        step = got_layout.batch_on_device(got.depth, got.token, "cuda")
        host = got.host()
        for field in ("seq", "depth", "token_id", "branch"):
            np.testing.assert_array_equal(getattr(host, field), getattr(want, field))
        ref = want_layout.batch(want, "cpu")
        for field in ("input_ids", "positions", "kv_write_rows", "kv_indices"):
            np.testing.assert_array_equal(getattr(step, field).cpu().numpy(), getattr(ref, field).numpy(), field)
        np.testing.assert_array_equal(step.tree.hi.cpu().numpy(), ref.tree.hi.numpy())
