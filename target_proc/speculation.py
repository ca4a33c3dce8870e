"""What crosses the spec link for one sequence and round, as target_proc sees it.

Pure data and checks over protocol structs, no sockets: a speculation
(protocol.sparse_q.DraftTokens) is the draft's proposal that one verify round checks,
an `Outcome` is what the round tells the draft back, and `inconsistent` / `vocab_cuts`
vet a SpecResponse before any of it is used.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, NamedTuple

import numpy as np

from protocol.messages import SpecRequest, SpecResponse
from protocol.sparse_q import DraftTokens


class Outcome(NamedTuple):
    """What one round tells the draft of one sequence. The per-step path builds plain
    tuples in this field order (a tuple is made several times faster than a named one);
    spec_request takes either."""

    seq_id: int
    round: int
    num_accepted: int
    token_id: int  # recovery or bonus token
    seq_len: int  # confirmed length including token_id


def spec_request(step: int, outcomes: list[Outcome], k: int, work_ahead: bool, branches: int = 0,
                 backup: str = "") -> SpecRequest:
    """One step's outcomes (Outcomes, or tuples in its field order) as the message the
    draft answers: one pass over the rows, not one per field."""
    n, width = len(outcomes), len(Outcome._fields)
    cols = np.fromiter(chain.from_iterable(outcomes), np.int64, n * width).reshape(n, width).T.copy()  # [5, N]
    return SpecRequest(
        step=step,
        seq_ids=cols[0],
        rounds=cols[1],
        num_accepted=cols[2].astype(np.int32),
        token_ids=cols[3],
        seq_lens=cols[4],
        k=k,
        work_ahead=work_ahead,
        branches=branches,
        backup=backup,
    )


def answered(work_ahead: bool, backup: str) -> bool:
    """Whether the draft answers a request: not one without work-ahead or backup (a
    plain step's, which nobody waits for)."""
    return work_ahead or backup != "none"


def inconsistent(msg: SpecResponse) -> str | None:
    """Why the arrays of a SpecResponse do not fit together, or None. The codec checks
    each array alone; a peer could still send B seq ids with fewer rounds."""
    b = msg.seq_ids.shape[0] if msg.seq_ids.ndim == 1 else -1
    ids = msg.draft_token_ids
    if b < 0 or ids.ndim != 2 or ids.shape[0] != b:
        return f"seq_ids {msg.seq_ids.shape}, draft_token_ids {ids.shape}"
    for name in ("rounds", "num_draft_tokens", "cache_hit", "hit_rank"):
        if getattr(msg, name) is not None and getattr(msg, name).shape != (b,):
            return f"{name} {getattr(msg, name).shape} for {b} sequences"
    q_ids, q_probs = msg.q_token_ids, msg.q_probs
    if q_ids is not None and q_ids.size and (q_ids.ndim != 3 or q_ids.shape[:2] != ids.shape
                                             or q_probs is None or q_probs.shape != q_ids.shape):
        return f"q_token_ids {q_ids.shape}, q_probs {None if q_probs is None else q_probs.shape}, draft {ids.shape}"
    return None


def has_q(msg: SpecResponse) -> bool:
    """Whether the response carries sparse q (absent when every sequence is greedy)."""
    return msg.q_token_ids is not None and msg.q_probs is not None and msg.q_token_ids.size > 0


def vocab_cuts(msg: SpecResponse, vocab_size: int | None) -> np.ndarray | None:
    """Per sequence, the position of its first draft id (or q id) outside the target's
    vocabulary, or None when every proposed id is in it (one pass per message).
    Cutting a speculation there keeps verification exact: its length depends on the
    draft's proposal only, and the target samples the cut position itself."""
    if vocab_size is None or msg.draft_token_ids.size == 0:
        return None
    ids = msg.draft_token_ids  # [B, K]
    bad = (ids < 0) | (ids >= vocab_size)  # [B, K]
    if has_q(msg):
        q = msg.q_token_ids  # [B, K, top_k]
        bad |= ((q < 0) | (q >= vocab_size)).any(axis=-1)
    bad &= np.arange(ids.shape[1])[None, :] < np.asarray(msg.num_draft_tokens)[:, None]  # proposed only
    if not bad.any():
        return None
    return np.where(bad.any(axis=1), bad.argmax(axis=1), ids.shape[1])  # [B]


def response_rows(msg: SpecResponse) -> list[tuple[int, int]]:
    """(seq_id, round) of each row of a response."""
    return list(zip(np.asarray(msg.seq_ids).tolist(), np.asarray(msg.rounds).tolist()))


def awaited_rows(msg: SpecResponse, waiting: dict[int, int],
                 vocab_size: int | None) -> Iterator[tuple[int, int, DraftTokens | None, int]]:
    """The rows of a consistent response that answer an awaited round ({seq_id: round}), as
    (row, seq_id, speculation, draft tokens cut as out of vocabulary). The speculation is
    None when the row's num_draft_tokens does not fit its arrays. Other rows are stale: a
    round no longer awaited, or a released sequence."""
    with_q = has_q(msg)
    cuts = vocab_cuts(msg, vocab_size)  # [B] or None
    for b in range(len(msg.seq_ids)):
        sid = int(msg.seq_ids[b])
        if waiting.get(sid) != int(msg.rounds[b]):
            continue
        m = int(msg.num_draft_tokens[b])
        if not 0 <= m <= msg.draft_token_ids.shape[1]:
            yield b, sid, None, 0
            continue
        cut = m if cuts is None else min(m, int(cuts[b]))
        yield b, sid, DraftTokens(
            draft_token_ids=msg.draft_token_ids[b, :cut].astype(np.int64, copy=False),
            q_token_ids=msg.q_token_ids[b, :cut] if with_q else None,
            q_probs=msg.q_probs[b, :cut] if with_q else None,
            cache_hit=bool(msg.cache_hit[b]),
            hit_rank=-1 if msg.hit_rank is None else int(msg.hit_rank[b]),
        ), m - cut
