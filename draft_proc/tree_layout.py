"""The first tree step of a work-ahead, laid out before its forks are chosen.

SSDEngine.work_ahead chooses its forks from the glue's ranking, which the host reads back
from the GPU. What the first tree step reads besides the forks' depths and tokens (each
sequence's shared prefix, the rows of its drafts, each branch's scratch rows, the
padding) depends only on how many forks each sequence gets, which its drafts count,
fan-out and budget fix (`fork_count`), provided every branch gets the same number of own
rows: its accepted drafts, its K scratch rows, then the dummy row, which its window never
reaches. So the engine lays the step out while the glue's forward runs (`TreeLayout`) and,
once the forks are chosen, writes in what their depths and tokens decide (`batch`): each
branch's token, position, window and the order of its own rows.
"""

from __future__ import annotations

import numpy as np

from draft_proc.tree_cache import Forks
from spec_runtime.engine.forward_batch import ForwardBatch, tree_arrays


def fork_count(m: int, fan: tuple[int, ...], per_seq: int) -> int:
    """The forks select_forks gives a sequence with m drafts, fan-out `fan` and a budget of
    per_seq branches when its ranking holds at least F_j + 1 tokens at every depth j."""
    return min(per_seq, sum(fan[: m + 1]))


def fork_counts(groups: dict[tuple[int, tuple[int, ...]], list[int]], num_seqs: int, per_seq: int) -> np.ndarray:
    """fork_count of every sequence [num_seqs]; groups: (m, fan-out) -> sequence indices."""
    counts = np.zeros(num_seqs, dtype=np.int64)
    for (m, fan), idx in groups.items():
        counts[idx] = fork_count(m, fan, per_seq)
    return counts


class TreeLayout:
    """A tree step's inputs for `counts` [B] forks per sequence (F in all, sequence by
    sequence, each sequence's numbered from 0), before their depths and tokens are known.

    prefixes: the rows [0, n) of each sequence with forks; n [B]: the sequences' lengths;
    accepted [R, A]: each such sequence's rows of its drafts d_1..d_m (padded with
    dummy_row); scratch [B]: each sequence's first scratch row, its branch b's first row
    scratch + b * stride (TreeCache.scratch_rows); k: the tree's steps.
    """

    def __init__(self, prefixes, counts: np.ndarray, n: np.ndarray, accepted: np.ndarray, scratch: np.ndarray,
                 stride: int, k: int, q_len: int, dummy_row: int):
        f = int(counts.sum())
        self.seq = np.repeat(np.arange(len(counts)), counts)  # [F]
        self.branch = np.arange(f) - (np.cumsum(counts) - counts)[self.seq]
        request = (np.cumsum(counts > 0) - 1)[self.seq]
        scratch = scratch[self.seq] + self.branch * stride  # [F] each branch's first scratch row
        self.width = accepted.shape[1] + k
        local = np.full((f, self.width), dummy_row, dtype=np.int64)
        local[:, 0] = scratch  # the one row seen so far: the row the step writes, whatever the depth
        self.arrays = tree_arrays(prefixes, request, np.zeros(f, dtype=np.int64), n[self.seq], local,
                                  np.full(f, self.width), np.ones(f, dtype=np.int64), q_len, dummy_row)
        tok = self.arrays.token
        self.own = self.arrays.kv_indptr[request].astype(np.int64) + self.arrays.lo[tok]  # [F] own rows' start
        self.accepted = np.pad(accepted, ((0, 0), (0, k)), constant_values=dummy_row)[request]  # [F, width]
        self.scratch, self.n, self.k, self.dummy_row = scratch, n[self.seq], k, dummy_row

    def matches(self, forks: Forks) -> bool:
        """Whether `forks` come as many per sequence as this layout holds."""
        return len(forks) == len(self.seq) and bool((forks.seq == self.seq).all())

    def batch(self, forks: Forks, device) -> ForwardBatch:
        """The first tree step of `forks` (matches: True), on `device`. Once per layout."""
        a, d = self.arrays, forks.depth
        tok = a.token
        a.input_ids[tok] = forks.token_id
        a.positions[tok] = self.n + d
        a.hi[tok] = a.lo[tok] + d + 1
        col = np.arange(self.width)[None, :]
        rows = np.where(col < d[:, None], self.accepted,
                        np.where(col < d[:, None] + self.k, self.scratch[:, None] + col - d[:, None], self.dummy_row))
        a.kv_indices[self.own[:, None] + col] = rows
        return a.upload(device)
