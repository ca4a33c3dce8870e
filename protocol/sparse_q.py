"""Sparse q: how a draft token's distribution travels and is stored.

For draft token i, q is zero outside q_token_ids[i] (its top-k ids, with
probabilities q_probs[i]). A greedy draft samples its token with probability 1, so
its q is one-hot: the token itself in column 0. Batches that mix greedy and sampled rows
use the sampled layout for every row, the greedy ones one-hot.
"""

from __future__ import annotations

import numpy as np


def put_q(q_token_ids: np.ndarray, q_probs: np.ndarray, at: tuple, draft_token_ids: np.ndarray,
          src_ids: np.ndarray | None = None, src_probs: np.ndarray | None = None) -> None:
    """Write the q of some draft tokens into dense arrays [..., top].

    at: the leading index of the rows written, e.g. (b, slice(0, m)). src_ids, src_probs
    [..., w] (w <= top): the drafts' sparse q, into the first w columns; None (a greedy
    draft): one-hot on draft_token_ids, whose shape is that of the indexed rows.
    """
    if src_ids is None:
        q_token_ids[(*at, 0)] = draft_token_ids
        q_probs[(*at, 0)] = 1.0
    else:
        w = src_ids.shape[-1]
        q_token_ids[(*at, slice(0, w))] = src_ids
        q_probs[(*at, slice(0, w))] = src_probs
