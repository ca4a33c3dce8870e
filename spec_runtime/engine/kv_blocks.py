"""Paged KV: the pool's rows in fixed-size blocks, a block table per sequence, prefix caching.

Pure CPU bookkeeping (no torch), testable without a model. The KV pool (kv_cache.py) is
`num_blocks * block_size` rows; block b holds rows [b * block_size, (b + 1) * block_size).
A sequence's block table lists its blocks in position order, so the row of position p is

    table[p // block_size] * block_size + p % block_size

and the attention kernels, which read an explicit row list per request
(forward_batch.ForwardItem.kv_rows), need nothing else. Blocks are taken as a sequence
grows and returned when it finishes, is aborted or is preempted.

Prefix caching: once a full block holds final K/V (its tokens are accepted and fed), it
is named by a hash of (its parent block's hash, its token ids), so one hash names the
whole prefix up to the block's end. A later sequence whose prompt starts with the same
full blocks takes them (one more reference each) instead of prefilling them again. A
block nobody references keeps its hash and stays findable until the pool needs it:
free blocks are handed out least recently freed first, blocks without a hash before
any with one. Shared blocks are never written: a sequence only writes positions past
its cached prefix, and only full blocks below its final K/V are ever hashed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: sha256 over the parent's name and the block's token ids.
    A cryptographic hash, so a crafted prompt cannot collide with another's cached K/V."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockPool:
    """The blocks of one KV pool: reference counts, the free list (LRU) and the
    hash -> block map of prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the block holding that prefix's K/V
        # Unreferenced blocks, the next one to hand out first.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (cached ones nobody references included)."""
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with one reference each, evicting cached ones as needed; None (and
        nothing taken) when fewer than n are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:  # evict: its K/V is about to be overwritten
                del self.cached[h]
                self.hash_of[b] = None
            self.ref_count[b] = 1
            out.append(b)
        return out

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (not yet referenced)."""
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each of `blocks` (cached blocks found by lookup)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. A block nobody references goes back to the
        free list: at its end if it is cached (evicted last), at its front if not.
        Callers release a table tail first, so a prefix's head outlives its tail."""
        for b in blocks:
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.hash_of[b] is None:
                    self.free.move_to_end(b, last=False)

    def register(self, block: int, h: bytes) -> None:
        """Name a full block of final K/V. A prefix already cached in another block keeps
        that one; this block then stays unnamed and is freed as a plain block."""
        if not self.enable_prefix_caching or self.hash_of[block] is not None or h in self.cached:
            return
        self.cached[h] = block
        self.hash_of[block] = h


class KVBlocks:
    """The block tables of one process's sequences over one BlockPool.

    `admit` gives a sequence its table (reusing cached prefix blocks), `grow` extends it,
    `rows` turns it into pool rows, `commit` names its newly final full blocks, `free`
    returns it. Counters, in tokens as vLLM counts them: `prefix_cache_queries` (prompt
    tokens of admitted sequences) and `prefix_cache_hits` (those found cached).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self._rows: dict[int, np.ndarray] = {}  # seq_id -> rows of its whole table
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> names of its leading full blocks
        self._num_named: dict[int, int] = {}  # seq_id -> leading blocks of its table already registered
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_rows(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_rows: int) -> int:
        return cdiv(num_rows, self.block_size)

    def _prefix_hashes(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> list[bytes]:
        """Names of the full blocks within token_ids[:num_tokens], kept per sequence."""
        hashes = self._hashes.setdefault(seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(block_hash(hashes[-1] if hashes else b"", token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def lookup_hashes(self, seq_id: int, token_ids: Sequence[int]) -> list[bytes]:
        """Names of the full blocks `admit` looks up for token_ids (all but the last token);
        empty without prefix caching."""
        if not self.pool.enable_prefix_caching:
            return []
        return self._prefix_hashes(seq_id, token_ids, len(token_ids) - 1)

    def admit(self, seq_id: int, token_ids: Sequence[int], num_rows: int, num_prompt_tokens: int,
              headroom: int = 0, use_cache: bool = True) -> int | None:
        """Give seq_id a table of `num_rows` rows. With prefix caching, its leading full
        blocks that are cached are reused; the last token is never among them, so a
        forward always has at least one token to compute. Returns the tokens found
        cached (the forward starts there), or None when the pool cannot hold the rest
        now with `headroom` blocks to spare (nothing is taken). num_prompt_tokens: what
        the query counters add. use_cache False: look nothing up (a forward that needs
        every prompt position's logits), count nothing."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has KV blocks")
        cached: list[int] = []
        use_cache = use_cache and self.pool.enable_prefix_caching
        if use_cache:
            cached = self.pool.lookup(self._prefix_hashes(seq_id, token_ids, len(token_ids) - 1))
        num_new = self.blocks_for(num_rows) - len(cached)
        taken_from_free = sum(1 for b in cached if self.pool.ref_count[b] == 0)
        if num_new + headroom > self.pool.num_free - taken_from_free:
            return None
        self.pool.acquire(cached)
        fresh = self.pool.allocate(max(0, num_new))
        self.tables[seq_id] = cached + (fresh or [])
        self._set_rows(seq_id)
        self._num_named[seq_id] = len(cached)
        num_cached = len(cached) * self.block_size
        if use_cache:
            self.prefix_cache_queries += num_prompt_tokens
            self.prefix_cache_hits += min(num_cached, num_prompt_tokens)
        return num_cached

    def grow(self, seq_id: int, num_rows: int) -> bool:
        """Extend seq_id's table to hold num_rows rows; False (nothing taken) when the
        pool has too few free blocks."""
        table = self.tables[seq_id]
        need = self.blocks_for(num_rows) - len(table)
        if need <= 0:
            return True
        fresh = self.pool.allocate(need)
        if fresh is None:
            return False
        table.extend(fresh)
        self._set_rows(seq_id)
        return True

    def rows(self, seq_id: int, length: int) -> np.ndarray:
        """Pool rows of positions [0, length) of seq_id."""
        rows = self._rows[seq_id]
        if length > len(rows):
            raise ValueError(f"sequence {seq_id} holds {len(rows)} KV rows, {length} asked")
        return rows[:length]

    def commit(self, seq_id: int, token_ids: Sequence[int], num_final: int) -> None:
        """Positions [0, num_final) of seq_id hold final K/V of token_ids: name the full
        blocks among them for later sequences (prefix caching)."""
        if not self.pool.enable_prefix_caching or seq_id not in self.tables:
            return
        table = self.tables[seq_id]
        num_full = min(num_final // self.block_size, len(table))
        start = self._num_named[seq_id]
        if num_full <= start:
            return
        hashes = self._prefix_hashes(seq_id, token_ids, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.register(table[i], hashes[i])
        self._num_named[seq_id] = num_full

    def free(self, seq_id: int) -> None:
        """Return seq_id's blocks (tail first) and forget its table; no-op if it has none."""
        table = self.tables.pop(seq_id, None)
        self._rows.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._num_named.pop(seq_id, None)
        if table is not None:
            self.pool.release(table[::-1])

    def _set_rows(self, seq_id: int) -> None:
        table = np.asarray(self.tables[seq_id], dtype=np.int64)
        self._rows[seq_id] = (table[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
