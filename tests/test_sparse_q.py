"""protocol.sparse_q: one sequence's draft tokens and q, and their dense batch layout."""

from __future__ import annotations

import numpy as np

from protocol.messages import PLACEHOLDER_TOKEN_ID
from protocol.sparse_q import NO_DRAFT, DraftTokens, pack


def test_pack_lays_out_greedy_and_sampled_rows():
    sampled = DraftTokens(np.array([5, 6]), np.array([[5, 9], [6, 2]]), np.array([[0.7, 0.3], [0.6, 0.4]], np.float32))
    greedy = DraftTokens(np.array([8, 1, 4]))
    ids, num, q_ids, q_probs = pack([sampled, NO_DRAFT, greedy], k=3)
    assert ids.tolist() == [[5, 6, PLACEHOLDER_TOKEN_ID], [PLACEHOLDER_TOKEN_ID] * 3, [8, 1, 4]]
    assert num.tolist() == [2, 0, 3] and num.dtype == np.int32
    assert q_ids.shape == q_probs.shape == (3, 3, 2)
    assert q_ids[0, :2].tolist() == [[5, 9], [6, 2]] and np.allclose(q_probs[0, :2], [[0.7, 0.3], [0.6, 0.4]])
    # A greedy row among sampled ones: one-hot on its own token.
    assert q_ids[2, :, 0].tolist() == [8, 1, 4] and q_probs[2].tolist() == [[1.0, 0.0]] * 3
    assert not q_probs[1].any()


def test_pack_without_q_and_forced_q():
    rows = [DraftTokens(np.array([3])), DraftTokens(np.array([4, 5]))]
    ids, num, q_ids, q_probs = pack(rows, k=2)
    assert q_ids is None and q_probs is None and num.tolist() == [1, 2]
    _, _, q_ids, q_probs = pack(rows, k=2, with_q=True, top_k=4)  # a batch with a sampling sequence
    assert q_ids.shape == (2, 2, 4) and q_ids[:, :, 0].tolist() == [[3, 0], [4, 5]]
    assert q_probs[:, :, 0].tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_head_keeps_q_aligned():
    d = DraftTokens(np.array([1, 2, 3]), np.arange(6).reshape(3, 2), np.ones((3, 2), np.float32), cache_hit=True)
    h = d.head(2)
    assert h.draft_token_ids.tolist() == [1, 2] and h.q_token_ids.tolist() == [[0, 1], [2, 3]]
    assert h.q_probs.shape == (2, 2) and h.cache_hit and h.num_draft_tokens == 2
    assert DraftTokens(np.array([1, 2])).head(1).q_token_ids is None
