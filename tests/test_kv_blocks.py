"""KV block pool and block tables (spec_runtime/engine/kv_blocks.py): allocation, rows,
prefix caching with reference counts and LRU eviction. Pure CPU, no model."""

from __future__ import annotations

import numpy as np
import pytest

from spec_runtime.engine.kv_blocks import BlockPool, KVBlocks

BS = 4


def test_rows_follow_the_block_table():
    kv = KVBlocks(8, BS, enable_prefix_caching=False)
    assert kv.admit(1, list(range(6)), 6, 6) == 0
    assert kv.admit(2, list(range(3)), 3, 3) == 0
    assert kv.grow(1, 10)
    t1, t2 = kv.tables[1], kv.tables[2]
    assert len(t1) == 3 and len(t2) == 1 and not set(t1) & set(t2)
    want = np.concatenate([np.arange(b * BS, (b + 1) * BS) for b in t1])[:10]
    assert kv.rows(1, 10).tolist() == want.tolist()
    with pytest.raises(ValueError):
        kv.rows(2, 5)
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 8


def test_admit_and_grow_take_nothing_when_the_pool_is_short():
    kv = KVBlocks(3, BS, enable_prefix_caching=False)
    assert kv.admit(1, [1] * 8, 8, 8) == 0  # 2 blocks
    assert kv.admit(2, [2] * 8, 8, 8) is None and 2 not in kv.tables
    assert kv.num_free_blocks == 1
    assert kv.admit(2, [2] * 4, 4, 4, headroom=1) is None  # one block left for the running sequence
    assert not kv.grow(1, 13) and len(kv.tables[1]) == 2  # needs 2 more, 1 free
    assert kv.grow(1, 12) and kv.num_free_blocks == 0


def test_a_shared_prefix_is_found_and_counted_in_tokens():
    kv = KVBlocks(16, BS)
    system = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = system + [1, 2, 3]
    assert kv.admit(1, a, len(a), len(a)) == 0
    kv.commit(1, a, len(a))
    b = system + [7, 8]
    assert kv.admit(2, b, len(b), len(b)) == 8  # the two full blocks of the system prompt
    assert kv.tables[2][:2] == kv.tables[1][:2]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (len(a) + len(b), 8)
    # A different first block shares nothing, even with the same second block.
    c = [0] * BS + system[BS:]
    assert kv.admit(3, c, len(c), len(c)) == 0


def test_the_last_token_is_always_computed():
    kv = KVBlocks(16, BS)
    p = list(range(8))  # exactly two blocks
    kv.admit(1, p, 8, 8)
    kv.commit(1, p, 8)
    kv.free(1)
    assert kv.admit(2, p, 8, 8) == 4  # the second block holds the last token: recomputed
    assert kv.admit(3, p + [9], 9, 9) == 8


def test_only_final_full_blocks_are_named():
    kv = KVBlocks(16, BS)
    p = list(range(12))
    kv.admit(1, p, 12, 12)
    kv.commit(1, p, 7)  # one full block of final K/V
    assert kv.admit(2, p, 12, 12) == 4


def test_cached_blocks_outlive_their_sequence_until_evicted_lru():
    kv = KVBlocks(4, BS)
    old, new = [1] * 5, [2] * 5
    for sid, p in ((1, old), (2, new)):
        kv.admit(sid, p, 5, 5)
        kv.commit(sid, p, 5)
        kv.free(sid)
    assert kv.num_free_blocks == 4  # cached blocks count as free
    # Blocks without a name go first; then the least recently freed name (old's).
    kv.admit(3, [3] * 8, 8, 8)
    assert kv.admit(4, new, 5, 5) == 4 and kv.admit(5, old, 5, 5) is None
    kv.free(4)
    kv.free(3)
    assert kv.admit(5, old, 5, 5) == 0


def test_a_referenced_block_is_never_evicted():
    pool = BlockPool(2, BS)
    [b] = pool.allocate(1)
    pool.register(b, b"x")
    pool.acquire(pool.lookup([b"x"]))
    pool.release([b])
    assert pool.allocate(2) is None  # one block still referenced
    assert pool.lookup([b"x"]) == [b]
    pool.release([b])
    assert len(pool.allocate(2)) == 2 and pool.lookup([b"x"]) == []
    with pytest.raises(RuntimeError):
        pool.release([b, b, b])


def test_no_block_leaks_over_random_admits_grows_and_frees():
    rng = np.random.default_rng(0)
    kv = KVBlocks(32, BS)
    live: dict[int, list[int]] = {}
    prefixes = [rng.integers(0, 50, 9).tolist() for _ in range(3)]
    for sid in range(2000):
        if live and rng.random() < 0.5:
            victim = int(rng.choice(list(live)))
            kv.commit(victim, live[victim], len(live[victim]) - 1)
            kv.free(victim)
            del live[victim]
            continue
        toks = prefixes[sid % 3] + rng.integers(0, 50, int(rng.integers(1, 9))).tolist()
        if kv.admit(sid, toks, len(toks) + 2, len(toks)) is None:
            kv.free(sid)
            continue
        live[sid] = toks
        if rng.random() < 0.5 and kv.grow(sid, len(toks) + 6):
            live[sid] = toks + [1, 2, 3, 4]
    for sid in list(live):
        kv.free(sid)
    assert kv.num_free_blocks == 32 and not kv.tables
    assert all(r == 0 for r in kv.pool.ref_count)
    assert kv.prefix_cache_hits > 0
