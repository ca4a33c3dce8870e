"""spec_runtime.kernels.rank (the glue's ranking in two kernels), run on the CPU by
Triton's interpreter, against torch.topk(torch.softmax(...)): the same tokens in the same
order and the same probabilities; rows with few finite logits yield distinct tokens, the
finite ones first; equal logits come lower index first."""

from __future__ import annotations

import numpy as np
import torch
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from spec_runtime.kernels.rank import BLOCK, top_probs  # noqa: E402


def _reference(logits: torch.Tensor, width: int):
    top = torch.topk(torch.softmax(logits.float(), dim=-1), width, dim=-1)
    return top.indices, top.values


def test_random_rows_rank_as_topk_of_softmax():
    gen = torch.Generator().manual_seed(3)
    for n, vocab, width in ((1, 300, 1), (5, BLOCK + 777, 4), (3, 2 * BLOCK + 1, 7), (2, BLOCK, 16)):
        logits = torch.randn((n, vocab), generator=gen) * 3
        ids, probs = top_probs(logits, width)
        want_ids, want_probs = _reference(logits, width)
        assert torch.equal(ids, want_ids), (n, vocab, width)
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


def test_a_strided_row_view_and_bf16_logits():
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn((4, 2 * 1000), generator=gen)
    view = wide[:, ::2]  # not contiguous in its rows
    ids, probs = top_probs(view, 3)
    want_ids, want_probs = _reference(view, 3)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
    half = torch.randn((2, 5000), generator=gen).to(torch.bfloat16)
    ids, probs = top_probs(half, 4)
    want_ids, want_probs = _reference(half, 4)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


def test_rows_with_few_finite_logits_yield_distinct_tokens():
    vocab = BLOCK + 100
    logits = torch.full((2, vocab), float("-inf"))
    logits[0, 7], logits[0, BLOCK + 3] = 1.0, 2.0  # two finite, in two chunks
    logits[1, 0] = 0.5
    ids, probs = top_probs(logits, 5)
    assert ids[0, :2].tolist() == [BLOCK + 3, 7] and ids[1, 0].item() == 0
    for row in ids.tolist():
        assert len(set(row)) == 5 and all(0 <= t < vocab for t in row)
    torch.testing.assert_close(probs[0, :2], torch.softmax(torch.tensor([2.0, 1.0]), 0))
    assert probs[0, 2:].eq(0).all() and probs[1, 0].item() == 1.0 and probs[1, 1:].eq(0).all()


def test_equal_logits_come_lower_index_first():
    logits = torch.zeros((1, 3 * BLOCK))
    logits[0, [5, BLOCK + 1, 2 * BLOCK + 9, 40]] = 1.0
    ids, probs = top_probs(logits, 6)
    assert ids[0].tolist() == [5, 40, BLOCK + 1, 2 * BLOCK + 9, 0, 1]
    assert np.allclose(probs[0, :4].numpy(), probs[0, 0].item()) and probs[0, 4] < probs[0, 0]
