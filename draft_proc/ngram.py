"""Prompt-lookup speculation: no model, just the sequence's own history.

For the longest suffix of length n in [ngram_min, ngram_max] that occurred earlier in
the sequence, propose the tokens that followed its most recent earlier occurrence. The
proposal is deterministic, so q is a point mass on each proposed token: verification
accepts d with probability p(d) and, on rejection, samples from p with d removed,
which keeps sampling exact.
"""

from __future__ import annotations

import numpy as np

from draft_proc.speculator import Speculator
from draft_proc.state import DraftSeq
from protocol.sparse_q import DraftTokens


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    tokens = np.asarray(token_ids, dtype=np.int64)
    n_tok = len(tokens)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        suffix = tokens[n_tok - n :]
        # Windows of length n starting at i, for i < n_tok - n (earlier occurrences only).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramSpeculator(Speculator):
    def __init__(self, ngram_min: int, ngram_max: int, max_model_len: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_model_len = max_model_len

    def propose(self, seqs: list[DraftSeq], k: int) -> list[DraftTokens]:
        out = []
        for seq in seqs:
            k_eff = max(0, min(k, self.max_model_len - seq.num_tokens))
            tokens = ngram_propose(seq.token_ids, k_eff, self.ngram_min, self.ngram_max) if k_eff else []
            out.append(DraftTokens(np.asarray(tokens, dtype=np.int64)))  # greedy: one-hot q
            # No KV is written: the slot stays valid up to the token before the last.
            seq.set_speculation(tokens, num_cached=min(seq.num_cached, seq.num_tokens - 1))
        return out
