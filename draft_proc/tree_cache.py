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
    of highest estimated probability win, whatever their depth.
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
    chosen = sorted(candidates[:max_branches], key=lambda c: (c[1], -c[0]))
    return [Fork(seq_id, j, t, i) for i, (_, j, t) in enumerate(chosen)]


class TreeCache:
    """Per-sequence maps from outcome (j, t) to a pre-computed speculation."""

    def __init__(self, max_branches: int, k: int, scratch_base: int):
        if max_branches < 1:
            raise ValueError("max_branches must be >= 1")
        self.max_branches = max_branches
        self.k = k
        self.scratch_base = scratch_base
        self._entries: dict[int, dict[tuple[int, int], DraftTokens]] = {}

    def scratch_rows(self, slot: int, branch: int, length: int) -> np.ndarray:
        """Rows of the first `length` tokens of a branch."""
        if not 0 <= branch < self.max_branches or not 0 <= length <= self.k:
            raise ValueError(f"branch {branch} / length {length} outside the budget")
        base = self.scratch_base + (slot * self.max_branches + branch) * self.k
        return np.arange(base, base + length, dtype=np.int64)

    def lookup(self, seq_id: int, depth: int, token_id: int) -> DraftTokens | None:
        return self._entries.get(seq_id, {}).get((depth, token_id))

    def replace(self, seq_id: int, entries: dict[tuple[int, int], DraftTokens]) -> None:
        """The speculation changed: the old branches answer outcomes that can no longer come."""
        if len(entries) > self.max_branches:
            raise ValueError(f"{len(entries)} entries exceed the budget of {self.max_branches}")
        self._entries[seq_id] = entries

    def clear(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)

    def num_entries(self) -> int:
        return sum(len(e) for e in self._entries.values())

    def num_seqs(self) -> int:
        return len(self._entries)
