"""The KV block pool: ref counts, the hashed prefix cache, and LRU eviction of free cached blocks.

Interface after mini-sglang's radix cache (``match_prefix``, ``insert``, ``lock``/``unlock``,
eviction), free list after vLLM v1's ``FreeKVCacheBlockQueue``: a doubly linked list with O(1)
removal, so a cached block that is hit again leaves the free list without a scan. A free block
keeps its hash until it is handed out again, which is what makes a finished chat's blocks
reusable by the next turn; the head of the free list is the least recently freed block and is
evicted first.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of a full block: its tokens, every token before it (through the parent's hash), and extra keys."""
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


class Block:
    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Free blocks in eviction order (head = least recently freed), with O(1) removal anywhere."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels keep the link code free of edge cases
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self._len += 1

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"block {block.block_id} is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> Block:
        first = self._head.next
        assert first is not None and first is not self._tail, "no free block"
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens; the pool never touches the tensors themselves."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-free ones included."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def match_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Ids of the blocks holding the longest cached prefix of ``block_hashes``; takes no reference."""
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hit.append(block.block_id)
        return hit

    def lock(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block; a free cached block leaves the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def unlock(self, block_ids: Iterable[int]) -> None:
        """Drop a reference on each block, in the given order; a block at zero joins the free list's tail."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} unlocked more often than locked"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` fresh blocks (ref count 1), evicting the least recently freed cached ones."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free; call can_allocate first")
        ids = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self.evict(block)
            block.ref_count = 1
            ids.append(block.block_id)
        return ids

    def evict(self, block: Block) -> None:
        """Forget a block's cached content (it is about to be overwritten)."""
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def insert(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash; a hash already held by another block is left alone."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def num_cached_free(self) -> int:
        return sum(1 for b in self.free_queue if b.block_hash is not None)

    def num_shared(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 1)

    def check_integrity(self) -> None:
        """Assert every invariant of the pool; for tests."""
        free = list(self.free_queue)
        assert len(free) == len(self.free_queue), "free list length is out of step"
        assert len({b.block_id for b in free}) == len(free), "a block is on the free list twice"
        assert all(b.ref_count == 0 for b in free), "a referenced block is on the free list"
        used = [b for b in self.blocks if b.ref_count > 0]
        assert len(used) + len(free) == self.num_blocks, "free + used != total"
        assert all(b.ref_count >= 0 for b in self.blocks)
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash map points at block {block.block_id} with another hash"
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.cached), "a block carries a hash the map does not know"
