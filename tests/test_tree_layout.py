"""The first tree step laid out before its forks are chosen (draft_proc/tree_layout.py).

Every branch of the layout gets the same number of own rows, so it differs from
forward_batch.build_tree_batch's layout in where rows sit, not in what a token sees: each
branch's token, position and write row, and the rows its window shows, in order, must be
build_tree_batch's. And a work-ahead through it must leave the same cache as the per-branch
layout, over rounds that hit and miss, with sequences of different drafts counts, greedy
and sampled, with the benchmark oracle, whether the forks match the layout laid out for
them or not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import save_tiny_model
from draft_proc.drafter import ModelDrafter
from draft_proc.ssd import SSDEngine
from draft_proc.state import DraftSeq
from draft_proc.tree_cache import Forks, select_forks_batch
from draft_proc.tree_budget import scratch_rows_needed
from draft_proc.tree_layout import TreeLayout, fork_count
from spec_runtime.bench.oracle import draft_oracle
from spec_runtime.config import ModelConfig, SpeculativeConfig
from spec_runtime.engine.forward_batch import tree_arrays
from spec_runtime.engine.runner import ModelRunner

K = 3
DUMMY = 9999


def test_fork_count_is_select_forks_batchs_count_with_a_wide_ranking():
    rng = np.random.default_rng(12)
    for _ in range(300):
        b, m = int(rng.integers(1, 5)), int(rng.integers(0, 5))
        fan = tuple(int(f) for f in rng.integers(0, 4, size=int(rng.integers(1, m + 3))))
        r = max(fan) + 1 + int(rng.integers(0, 3))
        ids = np.stack([rng.permutation(20)[:r] for _ in range(b * (m + 1))]).reshape(b, m + 1, r)
        probs = -np.sort(-rng.random(ids.shape), axis=2).astype(np.float32)
        drafts = rng.integers(0, 20, size=(b, m))
        budget = int(rng.integers(1, 10))
        _, _, count, _ = select_forks_batch(ids, probs, drafts, fan, budget, float(rng.random()))
        assert (count == fork_count(m, fan, budget)).all()


def _seen(batch, t):
    """Token t's visible rows, in order: its request's prefix, then its window."""
    tr, r = batch.tree, t // batch.max_q_len
    start = int(batch.kv_indptr_cpu[r])
    rows = batch.kv_indices.numpy()
    return (rows[start : start + int(tr.prefix_len_cpu[r])].tolist()
            + rows[start + int(tr.lo_cpu[t]) : start + int(tr.hi_cpu[t])].tolist())


def test_a_layout_shows_each_token_what_build_tree_batch_shows_it():
    rng = np.random.default_rng(3)
    for _ in range(50):
        counts = rng.integers(0, 4, size=int(rng.integers(1, 5)))
        counts[int(rng.integers(len(counts)))] = max(1, counts.max())  # some forks
        q_len, f = int(counts.max()) + int(rng.integers(0, 2)), int(counts.sum())
        n = rng.integers(3, 30, size=len(counts))
        m = rng.integers(0, K + 1, size=len(counts))
        present = np.flatnonzero(counts)
        prefixes = [1000 * (i + 1) + np.arange(n[i]) for i in present]
        accepted = np.full((len(present), int(m[present].max())), DUMMY)
        for r, i in enumerate(present):
            accepted[r, : m[i]] = 1000 * (i + 1) + n[i] + np.arange(m[i])
        seq_scratch = 50000 + 100 * np.arange(len(counts))  # each sequence's; its branches 10 rows apart
        layout = TreeLayout(prefixes, counts, n, accepted, seq_scratch, 10, K, q_len, DUMMY)
        seq = np.repeat(np.arange(len(counts)), counts)
        scratch = seq_scratch[seq] + 10 * layout.branch
        forks = Forks(seq=seq, depth=rng.integers(0, m[seq] + 1), token_id=rng.integers(0, 500, size=f),
                      branch=layout.branch)
        assert layout.matches(forks)
        got = layout.batch(forks, "cpu")
        # build_tree_batch's layout: own rows d_1..d_j, then the K scratch rows.
        request = (np.cumsum(counts > 0) - 1)[seq]
        col, d = np.arange(accepted.shape[1] + K)[None, :], forks.depth[:, None]
        local = np.where(col < d, np.pad(accepted, ((0, 0), (0, K)), constant_values=DUMMY)[request][:, col[0]],
                         scratch[:, None] + col - d)
        want = tree_arrays(prefixes, request, forks.token_id, n[seq] + forks.depth, local, forks.depth + K,
                           forks.depth + 1, q_len, DUMMY).upload("cpu")
        for t in layout.arrays.token.tolist():
            assert _seen(got, t) == _seen(want, t)
        for field in ("input_ids", "positions", "kv_write_rows"):
            np.testing.assert_array_equal(getattr(got, field).numpy(), getattr(want, field).numpy())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tree_layout") / "m", "llama")


def _engine(model_dir, spec, per_branch, forks_on_device=False):
    runner = ModelRunner(ModelConfig(path=model_dir), num_slots=3, max_model_len=128,
                         num_scratch_rows=scratch_rows_needed(spec, 3))
    drafter = ModelDrafter(runner, spec, logits_transform=draft_oracle(spec.synthetic_acceptance))
    engine = SSDEngine(drafter, drafter, spec)
    engine.forks_on_device = forks_on_device
    if per_branch:
        engine.tree_q_len = lambda *a: None
    return engine


def _dense(entry) -> np.ndarray:
    q = np.zeros((entry.q_token_ids.shape[0], 384), dtype=np.float64)
    np.put_along_axis(q, entry.q_token_ids, entry.q_probs, axis=1)
    return q


def _rounds(engines, temperature, rounds=6):
    """Rounds of look-up and work-ahead with the same outcomes for every engine (a cached
    one, a hit, or not; misses of every third round answered with no drafts, so drafts
    counts differ across sequences); each round's cache entries, engine by engine."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (7, 12, 30)]
    runs = [[DraftSeq(i, i, list(p), temperature=temperature, seed=100 + i) for i, p in enumerate(prompts)]
            for _ in engines]
    got = []
    for rnd in range(rounds):
        outcomes = []
        for s in runs[0]:
            keys, m = sorted(engines[0].cache.entries(s.seq_id)), len(s.draft_token_ids) if s.awaiting_outcome else 0
            if keys and rng.random() < 0.6:
                outcomes.append(keys[int(rng.integers(len(keys)))])
            else:
                outcomes.append((int(rng.integers(0, m + 1)), int(rng.integers(3, 384))))
        for engine, seqs in zip(engines, runs):
            for s, (j, t) in zip(seqs, outcomes):
                engine.note_outcome(s, j, t)
                s.apply_outcome(j, t, s.num_tokens + j + 1, rnd + 1)
            engine.propose(seqs, K, backup_k=0 if rnd % 3 == 2 else K)
            engine.work_ahead(seqs, K)
        got.append([[sorted(e.cache.entries(s.seq_id).items()) for s in seqs] for e, seqs in zip(engines, runs)])
    return got


@pytest.mark.parametrize("temperature,oracle,mismatch", [(0.0, (), False), (0.8, (), False),
                                                         (0.0, (0.8, 0.5, 0.2), False), (0.8, (), True)])
def test_the_laid_out_tree_leaves_the_per_branch_layouts_cache(model_dir, temperature, oracle, mismatch):
    """mismatch: every layout laid out before the forks expects one fork fewer for the
    first sequence, so the step lays out one of its own (forks chosen on the host, as
    everywhere but on a GPU)."""
    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(3, 2, 2, 1), draft_top_k=16, synthetic_acceptance=oracle)
    engines = [_engine(model_dir, spec, per_branch) for per_branch in (True, False)]
    laid_out = []
    layout_for = engines[1]._layout

    def recorded(seqs, counts, k):
        if mismatch and len(laid_out) % 2 == 0 and counts[0] > 1:
            counts = counts.copy()
            counts[0] -= 1
        layout = layout_for(seqs, counts, k)
        laid_out.append(layout)
        return layout

    engines[1]._layout = recorded
    for a, b in _rounds(engines, temperature):
        assert [[key for key, _ in row] for row in a] == [[key for key, _ in row] for row in b]
        for row_a, row_b in zip(a, b):
            for (_, ea), (_, eb) in zip(row_a, row_b):
                assert ea.draft_token_ids.tolist() == eb.draft_token_ids.tolist()
                if temperature > 0:  # the same q (near-equal probabilities may swap ranks)
                    np.testing.assert_allclose(_dense(ea), _dense(eb), atol=1e-5)
    # One layout per work-ahead, and with mismatch a second one for the forks.
    assert len(laid_out) == (12 if mismatch else 6) and all(x is not None for x in laid_out)


@pytest.mark.parametrize("temperature,oracle", [(0.0, ()), (0.8, ()), (0.0, (0.8, 0.5, 0.2)), (0.8, (0.8, 0.5, 0.2))])
def test_forks_chosen_on_the_device_leave_the_hosts_cache(model_dir, temperature, oracle):
    """The work-aheads of forks chosen where the glue ranks them (fork_device.py; a GPU's
    way, run here on CPU tensors) leave the cache that forks chosen on the host leave, with
    the benchmark oracle's steps picked by depth on the device as well."""
    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(3, 2, 2, 1), draft_top_k=16, synthetic_acceptance=oracle)
    engines = [_engine(model_dir, spec, False, on_device) for on_device in (False, True)]
    chosen = []
    choose = engines[1]._fork
    engines[1]._fork = lambda *a: chosen.append(choose(*a)) or chosen[-1]
    for a, b in _rounds(engines, temperature):
        assert [[key for key, _ in row] for row in a] == [[key for key, _ in row] for row in b]
        for row_a, row_b in zip(a, b):
            for (_, ea), (_, eb) in zip(row_a, row_b):
                assert ea.draft_token_ids.tolist() == eb.draft_token_ids.tolist()
                assert ea.hit_rank == eb.hit_rank
                if temperature > 0:
                    np.testing.assert_allclose(_dense(ea), _dense(eb), atol=1e-5)
    assert len(chosen) == 6 and all(type(f).__name__ == "DeviceForks" for f in chosen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_on_the_gpu_the_laid_out_tree_drafts_the_per_branch_layouts_tokens(tmp_path, temperature):
    """One work-ahead of three sequences on CUDA, the laid-out step replayed from a tree
    graph (Triton attention) against the per-branch layout run eagerly: the same forks,
    and the same tokens but where bf16 arithmetic over the two layouts tips an argmax
    or a draw; with forks chosen on the device, the laid-out step's own cache exactly."""
    from draft_proc.tree_budget import tree_local_rows, tree_shapes

    path = save_tiny_model(tmp_path / "m", "llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                           intermediate_size=2048, num_hidden_layers=4, initializer_range=0.02)
    spec = SpeculativeConfig(mode="ssd", k=K, fan_out=(3, 2, 2, 1), draft_top_k=16)
    engines = []
    for per_branch, on_device in ((True, False), (False, True), (False, False)):
        runner = ModelRunner.build(ModelConfig(path=path, device="cuda", gpu_memory_utilization=0.2), num_slots=3,
                                   max_model_len=128, num_scratch_rows=scratch_rows_needed(spec, 3), max_batch_size=4,
                                   graph_q_lens=(1, 2, K + 1), tree_shapes=tree_shapes(spec, 3),
                                   tree_local_rows=tree_local_rows(spec))
        drafter = ModelDrafter(runner, spec)
        engines.append(SSDEngine(drafter, drafter, spec))
        assert engines[-1].forks_on_device  # a GPU's default
        engines[-1].forks_on_device = on_device
        if per_branch:
            engines[-1].tree_q_len = lambda *a: None
    a, b, host = _rounds(engines, temperature, rounds=1)[0]
    # Forks chosen on the device replay the same graph as forks chosen on the host: the same cache.
    assert [[(key, e.draft_token_ids.tolist()) for key, e in row] for row in b] == \
        [[(key, e.draft_token_ids.tolist()) for key, e in row] for row in host]
    assert [[key for key, _ in row] for row in a] == [[key for key, _ in row] for row in b]
    pairs = [(ea, eb) for row_a, row_b in zip(a, b) for (_, ea), (_, eb) in zip(row_a, row_b)]
    same = sum(ea.draft_token_ids.tolist() == eb.draft_token_ids.tolist() for ea, eb in pairs)
    print(f"{torch.cuda.get_device_name()}: {same} of {len(pairs)} branches drafted the same tokens")
    assert len(pairs) > 0 and same >= 0.9 * len(pairs)
