"""The SSD tree cache: speculations pre-computed for the outcomes the draft expects.

Pure CPU bookkeeping (numpy only), testable without a model.

After returning speculation d_1..d_m for a sequence, the draft expects an outcome
(j, t): j of the m tokens accepted, then token t. For each depth j in 0..m it forks the
F_j tokens the target is most likely to produce there, ranked by the draft's own
distribution at that depth, *excluding d_{j+1}* for j < m (that outcome would have been
an accept, not a rejection at j). Each fork (j, t) becomes a branch whose next K
tokens are tree-decoded; the cache maps the key (seq_id, j, t) to those tokens and to
the q they were sampled from. A look-up that finds the key is a hit.

Branch KV lives in scratch rows: branch i of the sequence with index s (DraftSeq.slot,
draft_proc/kv.py) owns rows scratch_base + (s * max_branches + i) * K + [0, K). The
branch attends to its sequence's rows [0, n + j) (the prefix and the accepted drafts)
and to its own scratch rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol.messages import PLACEHOLDER_TOKEN_ID
from protocol.sparse_q import DraftTokens


@dataclass(frozen=True)
class Fork:
    """One branch to tree-decode: outcome (depth, token_id) of one sequence."""

    seq_id: int
    depth: int  # j: draft tokens accepted before the outcome token
    token_id: int  # t: the recovery (j < m) or bonus (j == m) token
    branch: int  # index among the sequence's branches (scratch rows)
    rank: int = 0  # by estimated probability among the sequence's forks, 0 the likeliest


@dataclass(frozen=True)
class Forks:
    """The branches of one work-ahead as arrays [F], sequence by sequence, each
    sequence's in branch order: its sequence (an index into the work-ahead's list),
    depth, token, index among its sequence's branches and rank (Fork's fields). A budget
    of n branches per sequence forks exactly those of rank < n: a look-up's rank tells
    whether every smaller tree would have hit too (None: not known)."""

    seq: np.ndarray
    depth: np.ndarray
    token_id: np.ndarray
    branch: np.ndarray
    rank: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.seq)


def select_forks(
    seq_id: int,
    ranked_token_ids: np.ndarray,
    ranked_probs: np.ndarray,
    draft_token_ids: np.ndarray,
    fan_out: tuple[int, ...],
    max_branches: int,
    accept_rate: float,
) -> list[Fork]:
    """Choose the branches of one sequence: the likeliest outcomes, F_j at most per depth.

    ranked_token_ids, ranked_probs: [m + 1, R] the draft's most likely tokens at each
    depth and their probabilities, best first (R >= max(fan_out) + 1, so that exclusion
    still leaves F_j candidates). draft_token_ids: [m], the speculation just returned.
    fan_out: F_0..F_K; depths past m are not forked (the speculation was shorter).

    The outcome (j, t) is estimated to have probability
        a^j (1 - a) q_j(t) / (1 - q_j(d_{j+1}))   for j < m (rejected at j+1, recovery t)
        a^m q_m(t)                                 for j = m (all accepted, bonus t)
    with a the running per-token acceptance rate and q_j the draft's distribution at
    depth j. When max_branches (the budget that keeps shapes fixed) binds, the forks
    of highest estimated probability win, whatever their depth (ties: the shallower,
    then the higher ranked). The chosen forks come in order of depth, then estimate, each
    with its rank by estimate (a smaller budget takes those of lower rank).
    """
    m = len(draft_token_ids)
    if ranked_token_ids.shape[0] != m + 1 or ranked_probs.shape != ranked_token_ids.shape:
        raise ValueError(f"need m + 1 = {m + 1} ranked rows of ids and probs, got {ranked_token_ids.shape}")
    a = min(max(accept_rate, 1e-3), 1 - 1e-3)
    candidates: list[tuple[float, int, int]] = []  # (estimated probability, depth, token)
    for j in range(m + 1):
        want = fan_out[j] if j < len(fan_out) else 0
        if want <= 0:
            continue
        ids, probs = ranked_token_ids[j].tolist(), ranked_probs[j].tolist()
        if j < m:
            excluded = int(draft_token_ids[j])
            q_excluded = next((p for t, p in zip(ids, probs) if t == excluded), 0.0)
            scale = a**j * (1 - a) / max(1e-6, 1.0 - q_excluded)
        else:
            excluded, scale = PLACEHOLDER_TOKEN_ID, a**m
        taken = 0
        for t, p in zip(ids, probs):
            if taken == want:
                break
            if t == excluded or t < 0:
                continue
            candidates.append((scale * p, j, int(t)))
            taken += 1
    candidates.sort(key=lambda c: (-c[0], c[1]))
    chosen = sorted(((*c, r) for r, c in enumerate(candidates[:max_branches])), key=lambda c: (c[1], -c[0]))
    return [Fork(seq_id, j, t, i, r) for i, (_, j, t, r) in enumerate(chosen)]


def select_forks_batch(ranked_token_ids: np.ndarray, ranked_probs: np.ndarray, draft_token_ids: np.ndarray,
                       fan_out: tuple[int, ...], max_branches: int,
                       accept_rate: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """select_forks for B sequences with the same number of drafts m, in a few array
    operations (from two sequences on, less host time than a select_forks call each):
    ranked_* [B, m + 1, R], draft_token_ids [B, m]. Returns the forks' depths and tokens
    [B, W] in branch order (row b's first count[b] entries are its branches), count [B]
    and the forks' ranks by estimate [B, W]."""
    ids = np.asarray(ranked_token_ids)
    b, rows, width = ids.shape
    m = draft_token_ids.shape[1]
    if rows != m + 1 or np.shape(ranked_probs) != ids.shape:
        raise ValueError(f"need m + 1 = {m + 1} ranked rows of ids and probs, got {ids.shape[1:]}")
    probs = np.asarray(ranked_probs, dtype=np.float64)
    a = min(max(accept_rate, 1e-3), 1 - 1e-3)
    powers = np.array([a**j for j in range(m + 1)])
    # Depth j < m excludes d_{j+1} (that outcome is an accept) and weighs by 1 - q_j(d_{j+1}).
    excluded = np.full((b, m + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    excluded[:, :m] = draft_token_ids
    match = ids == excluded[:, :, None]
    first = np.take_along_axis(probs, match.argmax(axis=2)[:, :, None], 2)[:, :, 0]
    q_excluded = np.where(match.any(axis=2), first, 0.0)  # its first match's probability
    scale = np.empty((b, m + 1))
    scale[:, :m] = powers[:m] * (1 - a) / np.maximum(1e-6, 1.0 - q_excluded[:, :m])
    scale[:, m] = powers[m]
    want = np.array([fan_out[j] if j < len(fan_out) else 0 for j in range(m + 1)])
    usable = ~match & (ids >= 0)
    taken = usable & (np.cumsum(usable, axis=2) <= want[None, :, None])  # the first F_j usable per depth
    est = np.where(taken, scale[:, :, None] * probs, -np.inf).reshape(b, -1)  # candidates in (depth, rank) order
    # Stable sorts: by estimate (ties keep (depth, rank) order), the best max_branches;
    # then by depth and estimate, the untaken candidates (estimate -inf) last.
    r = np.arange(b)[:, None]
    order = np.argsort(-est, axis=1, kind="stable")[:, :max_branches]
    est_c = est[r, order]
    rank = np.lexsort((-est_c, np.where(np.isfinite(est_c), order // width, m + 1)), axis=-1)
    order = order[r, rank]
    count = np.minimum(taken.sum(axis=(1, 2)), max_branches)
    return order // width, ids.reshape(b, -1)[r, order], count, rank


# Groups of up to this many sequences choose their forks one sequence at a time (fewer host
# operations than select_forks_batch's arrays for a single sequence).
FORK_LOOP_SEQS = 1


def select_forks_groups(groups: dict[tuple[int, tuple[int, ...]], list[int]], seqs, ranked, max_branches: int,
                        accept_rate: float) -> Forks:
    """The forks of a work-ahead's sequences `seqs` (DraftSeq: their draft_token_ids).
    groups: (m, fan-out) -> the indices of the sequences with m drafts that fork with that
    fan-out; ranked: (ids, probs [sum(m + 1), R], each sequence's first row [B])."""
    parts = []  # (sequence, depth, token, branch, rank) of each group's forks, sequence by sequence
    for (m, fan), idx in groups.items():
        if len(idx) <= FORK_LOOP_SEQS:
            for i in idx:
                a = ranked[2][i]
                fs = select_forks(i, ranked[0][a : a + m + 1], ranked[1][a : a + m + 1],
                                  np.asarray(seqs[i].draft_token_ids, dtype=np.int64), fan, max_branches, accept_rate)
                parts.append((np.full(len(fs), i, dtype=np.int64), np.array([f.depth for f in fs], dtype=np.int64),
                              np.array([f.token_id for f in fs], dtype=np.int64), np.arange(len(fs)),
                              np.array([f.rank for f in fs], dtype=np.int64)))
            continue
        drafts = np.array([seqs[i].draft_token_ids for i in idx], dtype=np.int64).reshape(len(idx), m)
        rows = ranked[2][idx][:, None] + np.arange(m + 1)  # [G, m + 1]
        d, t, c, r = select_forks_batch(ranked[0][rows], ranked[1][rows], drafts, fan, max_branches, accept_rate)
        g, branch = np.nonzero(np.arange(d.shape[1])[None, :] < c[:, None])  # each fork's row and column
        parts.append((np.asarray(idx, dtype=np.int64)[g], d[g, branch], t[g, branch], branch, r[g, branch]))
    if len(parts) == 1:
        return Forks(*parts[0])
    seq, depth, token, branch, rank = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(seq, kind="stable")  # each sequence's forks stay together and in order
    return Forks(seq=seq[order], depth=depth[order], token_id=token[order], branch=branch[order], rank=rank[order])


class BranchTable:
    """One work-ahead's speculations, as its arrays hold them: branch b's tokens[b, :lens[b]]
    and their q (None: greedy), and its fork's rank (Forks.rank; None: unknown). A branch's
    DraftTokens are made when a look-up asks for it."""

    def __init__(self, tokens: np.ndarray, q_ids: np.ndarray | None, q_probs: np.ndarray | None, lens: np.ndarray,
                 ranks: np.ndarray | None = None):
        self.tokens, self.q_ids, self.q_probs, self.lens, self.ranks = tokens, q_ids, q_probs, lens, ranks

    def __getitem__(self, b: int) -> DraftTokens:
        m, rank = int(self.lens[b]), -1 if self.ranks is None else int(self.ranks[b])
        if self.q_ids is None:
            return DraftTokens(self.tokens[b, :m], hit_rank=rank)
        return DraftTokens(self.tokens[b, :m], self.q_ids[b, :m], self.q_probs[b, :m], hit_rank=rank)


class TreeCache:
    """Per-sequence maps from outcome (j, t) to a pre-computed speculation."""

    def __init__(self, max_branches: int, k: int, scratch_base: int):
        if max_branches < 1:
            raise ValueError("max_branches must be >= 1")
        self.max_branches = max_branches
        self.k = k
        self.scratch_base = scratch_base
        # seq_id -> (outcome -> index into its table, the table: a list of DraftTokens or a BranchTable)
        self._entries: dict[int, tuple[dict[tuple[int, int], int], object]] = {}

    def scratch_rows(self, slot: int, branch: int, length: int) -> np.ndarray:
        """Rows of the first `length` tokens of a branch."""
        if not 0 <= branch < self.max_branches or not 0 <= length <= self.k:
            raise ValueError(f"branch {branch} / length {length} outside the budget")
        base = self.scratch_base + (slot * self.max_branches + branch) * self.k
        return np.arange(base, base + length, dtype=np.int64)

    def lookup(self, seq_id: int, depth: int, token_id: int) -> DraftTokens | None:
        keys, table = self._entries.get(seq_id, ({}, None))
        b = keys.get((depth, token_id))
        return None if b is None else table[b]

    def replace(self, seq_id: int, entries: dict[tuple[int, int], DraftTokens]) -> None:
        """The speculation changed: the old branches answer outcomes that can no longer come."""
        self.replace_rows(seq_id, {key: i for i, key in enumerate(entries)}, list(entries.values()))

    def replace_rows(self, seq_id: int, keys: dict[tuple[int, int], int], table) -> None:
        """replace, with each outcome's speculation at table[keys[outcome]] (a BranchTable:
        the rows of one work-ahead's arrays)."""
        if len(keys) > self.max_branches:
            raise ValueError(f"{len(keys)} entries exceed the budget of {self.max_branches}")
        self._entries[seq_id] = (keys, table)

    def entries(self, seq_id: int) -> dict[tuple[int, int], DraftTokens]:
        """Every outcome the sequence's cache answers, with its speculation."""
        keys, table = self._entries.get(seq_id, ({}, None))
        return {key: table[b] for key, b in keys.items()}

    def clear(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)

    def num_entries(self) -> int:
        return sum(len(keys) for keys, _ in self._entries.values())

    def num_seqs(self) -> int:
        return len(self._entries)
