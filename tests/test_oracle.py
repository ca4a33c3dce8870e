"""The synthetic acceptance oracle: configured rank frequencies, purity, and that the
real verification path turns alpha into the acceptance rate."""

from __future__ import annotations

import pytest
import numpy as np
import torch
from scipy import stats

from spec_runtime.bench.oracle import (
    MASKED_LOGIT,
    OracleConfig,
    draft_oracle,
    draft_oracle_logits,
    draft_oracle_rank,
    draft_oracle_slots,
    oracle_token,
    target_oracle,
    target_oracle_logits,
)
from spec_runtime.rejection import rejection_sample
from spec_runtime.sampling import SamplingTensors, target_probs

N = 100_000


def _rank_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """0-based rank of tokens[i] in logits[i] (ties broken by token id)."""
    order = torch.argsort(logits, dim=-1, descending=True, stable=True)  # [N, V]
    return (order == tokens.unsqueeze(-1)).float().argmax(-1)


def test_oracle_token_is_pure_and_uniform():
    seeds, pos = torch.arange(N) // 100, torch.arange(N) % 100
    o = oracle_token(seeds, pos, 50)
    assert o.min() >= 0 and o.max() < 50
    assert stats.chisquare(torch.bincount(o, minlength=50).numpy()).pvalue > 1e-3
    assert torch.equal(oracle_token(seeds.flip(0), pos.flip(0), 50), o.flip(0))
    assert (oracle_token(seeds + 1, pos, 50) != o).float().mean() > 0.9  # depends on the seed
    assert (oracle_token(seeds, pos + 1, 50) != o).float().mean() > 0.9  # and on the position


def test_target_oracle_logits_peak_on_the_oracle_token():
    seeds, pos = torch.arange(64), torch.arange(64) * 3
    o = oracle_token(seeds, pos, 40)
    logits = target_oracle_logits(torch.randn(64, 40, dtype=torch.bfloat16), seeds, pos)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits.argmax(-1), o)
    for temperature in (1.0, 0.7):
        st = SamplingTensors.from_params([(temperature, 0, 1.0, 0)] * 64)
        assert torch.equal(target_probs(logits, st), torch.eye(40)[o])  # one-hot when sampled too
    soft = target_oracle_logits(torch.zeros(64, 40), seeds, pos, peak_mass=0.9)
    torch.testing.assert_close(torch.softmax(soft, -1).max(-1).values, torch.full((64,), 0.9))
    # Leading dims [N, S]: each position gets its own oracle token.
    three = target_oracle_logits(torch.zeros(8, 5, 40), seeds[:8, None].expand(8, 5), pos[:8, None] + torch.arange(5))
    assert torch.equal(three.argmax(-1), oracle_token(seeds[:8, None].expand(8, 5), pos[:8, None] + torch.arange(5), 40))


@pytest.mark.parametrize("alpha,ranks", [(0.5, (0.4, 0.2)), (0.8, ()), (0.3, (0.3, 0.2, 0.1, 0.05)), (0.8, (0.5, 0.2, 0.1))])
def test_draft_oracle_rank_frequencies(alpha, ranks):
    vocab = 64
    seeds, pos = torch.arange(N) % 997, torch.arange(N) // 997
    logits = draft_oracle_logits(torch.zeros(N, vocab), seeds, pos, alpha, ranks)
    rank = _rank_of(logits, oracle_token(seeds, pos, vocab))
    num_slots = max(4, len(ranks) + 2)
    # ranks are conditional on a top-1 miss: rank r has probability (1 - alpha) ranks[r - 2].
    expected = [alpha] + [(1 - alpha) * r for r in ranks] + [(1 - alpha) * (1 - sum(ranks))]
    observed = torch.bincount(rank.clamp(max=len(ranks) + 1), minlength=len(expected)).double() / N
    # Absent means outside the top slots.
    assert (rank[rank > len(ranks)] >= num_slots).all()
    for obs, exp in zip(observed.tolist(), expected):
        assert abs(obs - exp) < 4 * (exp * (1 - exp) / N) ** 0.5 + 1e-9, (observed, expected)
    # Top slots: distinct tokens with logits 10, 9, 8, ...; every other token masked.
    top = torch.topk(logits, num_slots, dim=-1)
    assert torch.equal(top.values, (10.0 - torch.arange(num_slots, dtype=torch.float32)).expand(N, -1))
    assert (torch.sort(top.indices, -1).values.diff(dim=-1) > 0).all()
    assert ((logits == MASKED_LOGIT).sum(-1) == vocab - num_slots).all()
    # A greedy draft takes rank 1, so it predicts o_t with probability alpha.
    greedy_hit = (logits.argmax(-1) == oracle_token(seeds, pos, vocab)).double().mean().item()
    assert abs(greedy_hit - alpha) < 4 * (alpha * (1 - alpha) / N) ** 0.5 + 1e-9


def test_draft_oracle_is_a_pure_function_of_seed_and_position():
    seeds, pos = torch.tensor([3, 4, 3, 3]), torch.tensor([10, 10, 10, 11])
    a = draft_oracle_logits(torch.randn(4, 100), seeds, pos, 0.5, (0.2,))
    b = draft_oracle_logits(torch.randn(4, 100) * 50, seeds, pos, 0.5, (0.2,))
    assert torch.equal(a, b)  # the real logits' values do not matter
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[3])
    alone = draft_oracle_logits(torch.zeros(1, 100), seeds[1:2], pos[1:2], 0.5, (0.2,))
    assert torch.equal(alone[0], a[1])  # batch composition does not matter
    assert torch.equal(draft_oracle_rank(seeds, pos, 0.5, (0.2,))[[0, 2]], draft_oracle_rank(seeds[[2, 0]], pos[[2, 0]], 0.5, (0.2,)))


def test_oracle_validates():
    seeds, pos = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError):
        draft_oracle_logits(torch.zeros(2, 10), seeds, pos, 0.7, (0.6, 0.6))
    with pytest.raises(ValueError):
        draft_oracle_logits(torch.zeros(2, 10), seeds, pos, 1.2, ())
    with pytest.raises(ValueError):
        draft_oracle_logits(torch.zeros(2, 3), seeds, pos, 0.5, (0.1, 0.1, 0.1))
    with pytest.raises(ValueError):
        target_oracle_logits(torch.zeros(2, 10), seeds, pos, peak_mass=0.0)
    with pytest.raises(ValueError):
        oracle_token(seeds, pos, 0)


def test_greedy_verification_accepts_at_rate_alpha():
    """Through rejection_sample: a greedy draft's token at each slot is accepted iff the
    oracle put o_t at rank 1, and the recovery token is o_t."""
    n, k, vocab, alpha = 20_000, 3, 500, 0.7
    seeds, pos = torch.arange(n) * 7 + 1, torch.full((n,), 30)
    slot_pos = pos.unsqueeze(1) + torch.arange(k + 1)  # [N, K+1]
    slot_seeds = seeds.unsqueeze(1).expand(n, k + 1)
    draft = draft_oracle_logits(torch.zeros(n, k, vocab), slot_seeds[:, :k], slot_pos[:, :k], alpha, (0.2,))
    target = target_oracle_logits(torch.zeros(n, k + 1, vocab), slot_seeds, slot_pos)
    st = SamplingTensors.from_params([(0.0, 0, 1.0, int(s)) for s in seeds])
    res = rejection_sample(target, draft.argmax(-1), torch.full((n,), k), None, None, st, pos)
    for i in range(k):
        reached = res.num_accepted >= i
        rate = (res.num_accepted[reached] > i).double().mean().item()
        assert abs(rate - alpha) < 4 * (alpha * (1 - alpha) / reached.sum().item()) ** 0.5
    assert torch.equal(res.last_token_ids, oracle_token(seeds, pos + res.num_accepted, vocab))


def test_chain_transform_equals_per_step_transform():
    """The drafter's precomputed per-step oracle is the per-call oracle, step by step."""
    from types import SimpleNamespace

    tf = draft_oracle((0.8, 0.5, 0.2, 0.1))
    seqs = [SimpleNamespace(seed=s) for s in (3, 7, 7, -5)]
    positions = np.array([10, 10, 400, 0])
    vocab, steps = 97, 5
    chained = tf.chain(seqs, positions, steps, vocab, torch.device("cpu"))
    assert len(chained) == steps
    for i, step in enumerate(chained):
        logits = torch.randn(len(seqs), vocab)
        assert torch.equal(step(logits), tf(logits, seqs, positions + i))


def test_a_chain_with_offsets_on_the_device_is_the_chain_at_those_positions():
    """Forks chosen on the device move each row's positions on by its depth (offsets); the
    chain's steps are the per-call oracle at positions + offset + i."""
    from types import SimpleNamespace

    tf = draft_oracle((0.8, 0.5, 0.2, 0.1))
    seqs = [SimpleNamespace(seed=s) for s in (3, 7, 7, -5, 11)]
    positions = np.array([10, 10, 400, 0, 33])
    offsets = np.array([0, 3, 1, 2, 3])
    vocab, steps = 97, 4
    chained = tf.chain(seqs, positions, steps, vocab, torch.device("cpu"), offsets=(torch.from_numpy(offsets), 3))
    assert len(chained) == steps
    for i, step in enumerate(chained):
        logits = torch.randn(len(seqs), vocab)
        assert torch.equal(step(logits), tf(logits, seqs, positions + offsets + i))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_draft_oracle_writes_the_hosts_logits():
    """The draft oracle's kernel (per call and per chain step, with offsets) makes the
    logits its NumPy statement makes on the CPU, bit for bit."""
    from types import SimpleNamespace

    for values in ((0.8, 0.5, 0.2, 0.1), (0.6,), (1.0,), (0.0, 1.0)):
        tf = draft_oracle(values)
        seqs = [SimpleNamespace(seed=s) for s in (3, 7, 7, -5, 11, 2**62 + 9)]
        positions = np.array([10, 10, 400, 0, 33, 8191])
        offsets = np.array([0, 3, 1, 2, 3, 0])
        for vocab in (97, 128256):
            logits = torch.randn(len(seqs), vocab)
            assert torch.equal(tf(logits.cuda(), seqs, positions).cpu(), tf(logits, seqs, positions))
            chained = tf.chain(seqs, positions, 4, vocab, torch.device("cuda"),
                               offsets=(torch.from_numpy(offsets).cuda(), 3))
            for i, step in enumerate(chained):
                assert torch.equal(step(logits.cuda()).cpu(), tf(logits, seqs, positions + offsets + i))


_WARM_UP = r"""
import json
from types import SimpleNamespace
import numpy as np
import torch
from triton import knobs
from spec_runtime.bench.oracle import draft_oracle

met = {"warm_up": [], "serving": []}
phase = "warm_up"
knobs.runtime.jit_cache_hook = lambda *a, **kw: met[phase].append(kw["fn"].name)
tf, vocab = draft_oracle((0.8, 0.5, 0.2, 0.1)), 128256
tf.warm_up("cuda", vocab)
phase = "serving"
for batch in (1, 3, 16, 37):
    seqs = [SimpleNamespace(seed=s) for s in range(batch)]
    positions = np.arange(batch) + 500
    tf(torch.zeros(batch, vocab, device="cuda"), seqs, positions)
    for step in tf.chain(seqs, positions, 3, vocab, torch.device("cuda")):
        step(torch.zeros(batch, vocab, device="cuda"))
torch.cuda.synchronize()
print(json.dumps(met))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_draft_oracle_compiles_nothing_after_its_warm_up():
    """In a fresh process, DraftOracle.warm_up (the draft's start-up) meets the transform's
    kernel, and the transforms of batches of 1 to 37 rows after it meet no variant Triton
    has not compiled yet."""
    from fresh_python import run_json

    met = run_json(_WARM_UP)
    assert met == {"warm_up": ["_draft_logits_kernel"], "serving": []}


def test_config_field_builds_each_half_or_none():
    assert target_oracle(()) is None and draft_oracle(()) is None
    tf = draft_oracle((0.7, 0.2))
    assert (tf.alpha, tf.ranks) == (0.7, (0.2,)) and target_oracle((0.7,)) is not None
    with pytest.raises(ValueError, match="ranks"):
        OracleConfig(0.5, (0.8, 0.4))


def test_the_oracle_streams_are_fixed():
    """o_t, the draft's rank of it and its slots at a few (seed, t) are fixed values, so
    benchmarks of different commits put the same tokens in the same places; torch tensors
    and NumPy arrays give the same."""
    seeds = torch.tensor([0, -1, 2**62, 12345, -987654321, 42])
    pos = torch.tensor([0, 1, 7, 513, 2**31 - 1, 100000])
    assert oracle_token(seeds, pos, 151936).tolist() == [143945, 30966, 81772, 24068, 92999, 127315]
    assert draft_oracle_rank(seeds, pos, 0.8, (0.5, 0.2, 0.1)).tolist() == [0, 0, 0, 0, 1, 1]
    tokens, logits = draft_oracle_slots(seeds, pos, 1000, 0.8, (0.5, 0.2, 0.1))
    assert tokens.tolist() == [[809, 547, 548, 549, 550], [334, 68, 69, 70, 71], [164, 129, 130, 131, 132],
                               [244, 988, 989, 990, 991], [228, 855, 229, 230, 231], [691, 579, 692, 693, 694]]
    assert logits.tolist() == [10.0, 9.0, 8.0, 7.0, 6.0]
    # NumPy arrays and torch tensors give the same values.
    assert torch.equal(oracle_token(seeds.numpy(), pos.numpy(), 151936), oracle_token(seeds, pos, 151936))
