"""Draft tokens and their sparse q: the one host-side form of a speculation.

For draft token i, q is zero outside q_token_ids[i] (its top-k ids, with
probabilities q_probs[i]). A greedy draft samples its token with probability 1, so
its q is one-hot: the token itself in column 0. Batches that mix greedy and sampled rows
use the sampled layout for every row, the greedy ones one-hot.

`DraftTokens` is one sequence's speculation wherever it is held: as the draft proposes
it, in the SSD tree cache, and as the target verifies it. `pack` lays a batch of them
out densely, as SpecResponse carries them and as rejection sampling reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from protocol.messages import PLACEHOLDER_TOKEN_ID


@dataclass(frozen=True)
class DraftTokens:
    """One sequence's speculation d_1..d_m and the sparse q each token was sampled from."""

    draft_token_ids: np.ndarray  # [m] int64
    q_token_ids: np.ndarray | None = None  # [m, top_k] int64; None: greedy (one-hot q)
    q_probs: np.ndarray | None = None  # [m, top_k] float32
    cache_hit: bool = False  # SSD: answered from the tree cache
    hit_rank: int = -1  # SSD: the rank of the branch that answered (draft_proc.tree_cache.Forks; -1: unknown)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def sampled(self) -> bool:
        return self.q_token_ids is not None

    def head(self, m: int) -> "DraftTokens":
        """The first m tokens (views, no copy)."""
        if not self.sampled:
            return replace(self, draft_token_ids=self.draft_token_ids[:m])
        return replace(self, draft_token_ids=self.draft_token_ids[:m], q_token_ids=self.q_token_ids[:m],
                       q_probs=self.q_probs[:m])


NO_DRAFT = DraftTokens(np.zeros(0, dtype=np.int64))


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


def pack(specs: Sequence[DraftTokens], k: int, with_q: bool | None = None, top_k: int | None = None):
    """A batch of speculations, dense: draft_token_ids [B, k] int64 (PLACEHOLDER_TOKEN_ID
    past each row's drafts), num_draft_tokens [B] int32, and q_token_ids / q_probs
    [B, k, top_k] (None without q; a greedy row in a batch with q gets a one-hot q).

    with_q: whether to carry q (None: when some row has drafts with q). top_k: the q
    width (None: the widest row's, 1 when no row has q)."""
    b = len(specs)
    draft_ids = np.full((b, k), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    num = np.fromiter((s.num_draft_tokens for s in specs), np.int32, b)
    if with_q is None:
        with_q = any(s.sampled and s.num_draft_tokens for s in specs)
    q_ids = q_probs = None
    if with_q:
        if top_k is None:
            top_k = max((s.q_token_ids.shape[-1] for s in specs if s.sampled), default=1)
        q_ids = np.zeros((b, k, top_k), dtype=np.int64)
        q_probs = np.zeros((b, k, top_k), dtype=np.float32)
    for i, s in enumerate(specs):
        m = s.num_draft_tokens
        if not m:
            continue
        draft_ids[i, :m] = s.draft_token_ids
        if with_q:
            put_q(q_ids, q_probs, (i, slice(0, m)), s.draft_token_ids, s.q_token_ids, s.q_probs)
    return draft_ids, num, q_ids, q_probs
