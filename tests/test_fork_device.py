"""Forks chosen on the device (draft_proc/fork_device.py) are the forks the host chooses.

choose_on_device runs here on CPU tensors, through its torch statement (a GPU runs the
kernel that tests/test_triton_forks.py holds to that statement). Over
random rankings (ties included, sequences of different drafts counts and fan-outs, groups of
one and of several sequences) it must return select_forks_groups' forks, in the layout's
order, with the same depths, tokens and ranks; where a ranking holds fewer usable candidates
than the layout's count, the valid forks are the host's and the rest are marked invalid.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from draft_proc.fork_device import _FIELDS, _inputs, choose_on_device, rank, select_forks_device, write_first_step
from draft_proc.tree_cache import select_forks_groups
from draft_proc.tree_layout import TreeLayout, fork_counts


def _case(rng, wide: bool):
    b = int(rng.integers(1, 6))
    per_seq = int(rng.integers(1, 13))
    fan_hit = tuple(int(f) for f in rng.integers(0, 4, size=int(rng.integers(1, 6))))
    fan_miss = tuple(int(f) for f in rng.integers(1, 4, size=int(rng.integers(1, 6))))
    ms = rng.integers(0, 5, size=b)
    seqs, groups = [], {}
    for i, m in enumerate(ms.tolist()):
        fan = (fan_hit if rng.random() < 0.5 else fan_miss) if m else (per_seq,)
        groups.setdefault((m, fan), []).append(i)
        seqs.append(SimpleNamespace(draft_token_ids=rng.integers(0, 12, size=m).tolist()))
    width = max(max(fan_hit), max(fan_miss)) + 1
    if any(m == 0 for m in ms):
        width = max(width, per_seq)
    if not wide:
        width = max(1, width - int(rng.integers(1, 3)))
    rows = int((ms + 1).sum())
    ids = np.stack([rng.permutation(12)[:width] for _ in range(rows)])  # drafts often ranked: excluded
    probs = -np.sort(-np.round(rng.random((rows, width)), 1), axis=1).astype(np.float32)  # ties
    starts = np.concatenate([[0], np.cumsum(ms + 1)[:-1]]).astype(np.int64)
    return seqs, groups, (ids, probs, starts), per_seq, float(rng.random())


def layout_for(seqs, groups, per_seq, k=3, dummy=9999):
    """A TreeLayout of fork_count forks per sequence (made-up rows: prefix, drafts, scratch)."""
    counts = fork_counts(groups, len(seqs), per_seq)
    if not counts.any():
        return None  # SSDEngine lays nothing out, and forks nothing
    m = np.array([len(s.draft_token_ids) for s in seqs], dtype=np.int64)
    n = 20 + 3 * np.arange(len(seqs))
    present = np.flatnonzero(counts)
    prefixes = [1000 * (i + 1) + np.arange(n[i]) for i in present]
    accepted = np.full((len(present), max(1, int(m[present].max(initial=0)))), dummy, dtype=np.int64)
    for r, i in enumerate(present):
        accepted[r, : m[i]] = 1000 * (i + 1) + n[i] + np.arange(m[i])
    scratch = 50000 + 1000 * np.arange(len(seqs))
    q_len = max(1, int(counts.max()))
    return TreeLayout(prefixes, counts, n, accepted, scratch, k, k, q_len, dummy)


def _on_device(seqs, groups, ranked, per_seq, a):
    ids, probs, starts = ranked
    layout = layout_for(seqs, groups, per_seq)
    if layout is None:
        return "none"
    return choose_on_device((torch.from_numpy(ids), torch.from_numpy(probs), starts), groups,
                            [s.draft_token_ids for s in seqs], per_seq, a, layout)


def test_the_device_chooses_the_hosts_forks():
    rng = np.random.default_rng(5)
    for _ in range(400):
        seqs, groups, ranked, per_seq, a = _case(rng, wide=True)
        want = select_forks_groups(groups, seqs, ranked, per_seq, a)
        got = _on_device(seqs, groups, ranked, per_seq, a)
        if got == "none":
            assert len(want) == 0
            continue
        forks, valid = got.to_host()
        assert valid.all()
        for field in ("seq", "depth", "token_id", "branch", "rank"):
            np.testing.assert_array_equal(getattr(forks, field), getattr(want, field), err_msg=field)


def test_a_narrow_ranking_leaves_the_hosts_forks_valid_and_the_rest_marked():
    rng = np.random.default_rng(6)
    narrow = 0
    for _ in range(400):
        seqs, groups, ranked, per_seq, a = _case(rng, wide=False)
        want = select_forks_groups(groups, seqs, ranked, per_seq, a)
        got = _on_device(seqs, groups, ranked, per_seq, a)
        if got == "none":
            continue
        if got is None:  # more forks than candidates: the host chooses
            counts = fork_counts(groups, len(seqs), per_seq)
            m = np.array([len(s.draft_token_ids) for s in seqs])
            assert (counts > (m + 1) * ranked[0].shape[1]).any()
            continue
        forks, valid = got.to_host()
        narrow += int((~valid).any())
        for field in ("seq", "depth", "token_id", "branch", "rank"):
            np.testing.assert_array_equal(getattr(forks, field)[valid], getattr(want, field), err_msg=field)
    assert narrow > 20


def kernel_against_torch(device: str, rng, trials: int) -> tuple[int, int]:
    """spec_runtime.kernels.forks against the torch statement on the CPU, over `trials`
    random choices (wide and narrow rankings alternating): the same forks and the same
    step inputs, bit for bit. Returns the choices compared and those with invalid forks."""
    from spec_runtime.kernels.forks import fork_and_lay_out

    checked = narrow = 0
    for trial in range(trials):
        seqs, groups, (ids, probs, starts), per_seq, a = _case(rng, wide=trial % 2 == 0)
        layout = layout_for(seqs, groups, per_seq)
        drafts = [s.draft_token_ids for s in seqs]
        host = None if layout is None else _inputs(groups, drafts, per_seq, a, starts, ids.shape[1], layout)
        if host is None:
            continue
        arrays, depths = host
        got, want = [], []
        for out, dev in ((got, device), (want, "cpu")):
            first, views = layout.arrays.upload_with(dev, arrays)  # as choose_on_device uploads them
            v = dict(zip(_FIELDS, views))
            v["numer"] = v["numer"].view(torch.float64)
            t_ids, t_probs = torch.from_numpy(ids).to(dev), torch.from_numpy(probs).to(dev)
            if out is got:
                step = (first.input_ids, first.positions, first.tree.hi, first.kv_indices)
                forks = fork_and_lay_out(t_ids, t_probs, v, step, len(seqs), depths, layout.k, layout.width,
                                         layout.dummy_row)
            else:
                depth, token, rank, valid = select_forks_device(t_ids, t_probs, v, per_seq, depths)
                write_first_step(first, v, depth, token, layout)
                forks = torch.stack([depth, token, rank, valid.to(torch.int64)])
            out += [t.cpu() for t in (forks, first.input_ids, first.positions, first.tree.hi, first.kv_indices)]
        for g, w, name in zip(got, want, ("forks", "input_ids", "positions", "hi", "kv_indices")):
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)
        checked += 1
        narrow += int((want[0][3] == 0).any())
    return checked, narrow


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_kernel_chooses_and_writes_what_the_torch_statement_does():
    from spec_runtime.kernels.forks import warm_up

    warm_up(torch.device("cuda"), 4, 13)  # every variant the cases below can meet
    checked, narrow = kernel_against_torch("cuda", np.random.default_rng(9), trials=300)
    assert checked > 150 and narrow > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_ranking_kernels_rank_as_topk_of_softmax():
    gen = torch.Generator(device="cuda").manual_seed(5)
    for n, vocab, width in ((1, 128256, 4), (5, 128256, 4), (112, 151936, 16), (3, 1000, 7)):
        logits = torch.randn((n, vocab), generator=gen, device="cuda") * 4
        ids, probs = rank(logits, width)
        top = torch.topk(torch.softmax(logits, dim=-1), width, dim=-1)
        assert torch.equal(ids, top.indices), (n, vocab, width)
        torch.testing.assert_close(probs, top.values, rtol=1e-5, atol=1e-7)
