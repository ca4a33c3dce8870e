"""The draft's KV rows: a block table per sequence over the runner's paged pool.

Blocks come from spec_runtime/engine/kv_blocks.py, as in the target: a sequence takes
blocks as it grows and returns them when it is released, and full blocks of confirmed
tokens are named by their hash so that a later sequence with the same prefix (a shared
system prompt) starts its draft prefill after them. A sequence of n confirmed tokens
holds rows for n + K + 1 positions (capped at max_model_len): the chain drafter writes
d_1..d_{K-1} after them, the SSD glue x_n and d_1..d_K, and a tree branch reads the
accepted drafts there. Only positions below n - 1 are ever named: the glue re-feeds
x_n at n - 1, and a named block is never written again.

Each sequence also holds an index in [0, max_seqs): its SSD branches' scratch rows
(draft_proc/tree_cache.py) are those of that index. `SlotRows` gives the same `rows`
interface over a slot layout, for callers that build their runner by slots.
"""

from __future__ import annotations

import numpy as np

from draft_proc.state import DraftSeq
from spec_runtime.engine.forward_batch import PagedLayout, SlotLayout
from spec_runtime.engine.kv_blocks import KVBlocks


class SlotRows:
    """Rows of a slot layout: a sequence's rows are those of its slot."""

    def __init__(self, layout: SlotLayout):
        self.layout = layout

    def rows(self, seq: DraftSeq, length: int) -> np.ndarray:
        return self.layout.slot_rows(seq.slot, length)


class DraftKV:
    """Block tables and scratch indices of the draft's sequences; see the module doc."""

    def __init__(self, layout: PagedLayout, k: int, max_seqs: int, enable_prefix_caching: bool = True):
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        self.blocks = KVBlocks(layout.num_blocks, layout.block_size, enable_prefix_caching)
        self.max_model_len = layout.max_model_len
        self.k = k
        self.max_seqs = max_seqs
        self._free_indices = list(range(max_seqs))[::-1]

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def rows_needed(self, num_tokens: int) -> int:
        return min(num_tokens + self.k + 1, self.max_model_len)

    def admit(self, seq_id: int, token_ids: list[int]) -> tuple[int, int] | str:
        """A table for a new sequence of token_ids: (its index, tokens whose KV is cached),
        or why it cannot be held (nothing taken)."""
        if not self._free_indices:
            return f"the draft holds its most sequences ({self.max_seqs})"
        num_cached = self.blocks.admit(seq_id, token_ids, self.rows_needed(len(token_ids)), len(token_ids))
        if num_cached is None:
            return (f"no free draft KV blocks for {len(token_ids)} tokens "
                    f"({self.blocks.num_free_blocks} of {self.blocks.num_blocks} free)")
        return self._free_indices.pop(), num_cached

    def grow(self, seq: DraftSeq) -> bool:
        """Rows for the sequence's next round; False (nothing taken) when the pool is out."""
        return self.blocks.grow(seq.seq_id, self.rows_needed(seq.num_tokens))

    def commit(self, seq: DraftSeq) -> None:
        """Name the full blocks of confirmed tokens whose K/V is final (prefix caching)."""
        self.blocks.commit(seq.seq_id, seq.token_ids, min(seq.num_cached, seq.num_tokens - 1))

    def rows(self, seq: DraftSeq, length: int) -> np.ndarray:
        return self.blocks.rows(seq.seq_id, length)

    def free(self, seq: DraftSeq) -> None:
        if seq.seq_id in self.blocks.tables:
            self.blocks.free(seq.seq_id)
            self._free_indices.append(seq.slot)

    def counters(self) -> tuple[int, int]:
        """(prompt tokens looked up, prompt tokens found cached), vLLM's prefix-cache counters."""
        return self.blocks.prefix_cache_queries, self.blocks.prefix_cache_hits
