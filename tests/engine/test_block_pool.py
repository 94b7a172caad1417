"""Block pool and KV cache manager: ref counts, prefix hits, LRU eviction, tail-first freeing."""

from __future__ import annotations

import hashlib

import pytest

from localpaged.engine.block_pool import Block, BlockPool, FreeBlockQueue, hash_block
from localpaged.engine.kv_cache_manager import KVCacheManager
from localpaged.engine.sequence import Sequence


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), params=None)


def computed(kv: KVCacheManager, rid: str, tokens: list[int]) -> Sequence:
    """A sequence whose tokens are all allocated, computed and in the prefix cache."""
    s = seq(rid, tokens)
    kv.allocate(s, len(tokens))
    s.num_computed_tokens = len(tokens)
    kv.cache_blocks(s)
    return s


def test_hash_chains_parent_and_is_cryptographic():
    a = hash_block(None, [1, 2, 3])
    assert (
        a
        == hashlib.sha256(
            b"\0" * 32 + (1).to_bytes(8, "little") + (2).to_bytes(8, "little") + (3).to_bytes(8, "little")
        ).digest()
    )
    assert hash_block(a, [4]) != hash_block(hash_block(None, [9, 9, 9]), [4]), (
        "same tokens after another prefix must differ"
    )
    assert hash_block(None, [1, 2, 3], b"salt") != a


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2] and len(q) == 4


def test_prefix_hit_shares_blocks_and_recomputes_last_token():
    pool = BlockPool(10, 4)
    kv = KVCacheManager(pool)
    a = computed(kv, "a", list(range(12)))  # three full blocks
    b = seq("b", list(range(12)))  # identical prompt: the last block is recomputed for its logits
    hit = kv.get_computed_blocks(b)
    assert hit == a.block_table[:2]
    kv.allocate(b, 12 - 8, hit)
    assert (
        b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    )
    assert [pool.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    pool.check_integrity()
    kv.free(a)
    kv.free(b)
    assert pool.num_used_blocks == 0
    pool.check_integrity()


def test_free_is_tail_first_and_eviction_is_lru():
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool)
    a = computed(kv, "a", list(range(16)))
    table = list(a.block_table)
    kv.free(a)
    assert [b.block_id for b in pool.free_queue] == table[::-1], "tail blocks must be evicted before the prefix"
    new = pool.allocate(1)
    assert new == [table[-1]]
    assert pool.match_prefix(a.block_hashes) == table[:3], "the prefix survives; the evicted tail is forgotten"
    pool.check_integrity()


def test_cached_free_block_is_revived_without_copy():
    pool = BlockPool(3, 4)
    kv = KVCacheManager(pool)
    kv.free(computed(kv, "a", [1, 2, 3, 4, 5]))
    assert pool.num_cached_free() == 1
    b = seq("b", [1, 2, 3, 4, 9, 9])
    hit = kv.get_computed_blocks(b)
    assert len(hit) == 1 and kv.can_allocate(b, 2, hit)
    kv.allocate(b, 2, hit)
    assert pool.blocks[hit[0]].ref_count == 1 and pool.num_free_blocks == 1
    pool.check_integrity()


def test_can_allocate_counts_revived_free_blocks():
    pool = BlockPool(2, 4)
    kv = KVCacheManager(pool)
    kv.free(computed(kv, "a", [1, 2, 3, 4, 5]))
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # needs 3 blocks, one of them the cached one
    hit = kv.get_computed_blocks(b)
    assert not kv.can_allocate(b, 6, hit)


def test_allocate_beyond_free_raises_and_unlock_underflow_is_caught():
    pool = BlockPool(2, 4)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.allocate(3)
    with pytest.raises(AssertionError):
        pool.unlock([0])
