"""Sequence-level use of the block pool: prefix hits at admission, slots for new tokens, caching, freeing.

The scheduler speaks in sequences and token counts; this turns that into pool operations, as
vLLM v1's KVCacheManager does. Verbs come in pairs: ``can_allocate``/``allocate``, ``free``.

With a disk tier (localpaged.engine.kv_disk) below the pool, the prefix match goes on past the
blocks in memory: blocks found on disk are read into free pool blocks and registered in the prefix
cache, so the ordinary match then finds them and only the tail is prefilled. A prompt's full blocks
are saved once it is prefilled, and every computed full block when its sequence is freed; saving
copies the blocks out of the pool at once (they may be handed out again at the next step) and
leaves the writing to the tier's thread.
"""

from __future__ import annotations

from typing import Protocol

from localpaged.engine.block_pool import BlockPool, hash_block
from localpaged.engine.kv_disk import KVDiskTier
from localpaged.engine.sequence import Sequence


class BlockMover(Protocol):
    """Copies blocks' bytes out of and into the KV tensor (the model runner); keeps this module torch-free."""

    def gather_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """A private copy of each block's bytes, in the tier's block layout."""
        ...

    def block_buffers(self, block_ids: list[int]) -> list[list[memoryview]]:
        """Writable buffers of each block, in ``gather_blocks``' layout, for the disk tier to read into."""
        ...

    def commit_blocks(self, block_ids: list[int]) -> None:
        """Make what was read into ``block_buffers``' first ``len(block_ids)`` blocks their contents."""
        ...

    def copy_block(self, src: int, dsts: list[int]) -> None:
        """Copy block ``src``'s K and V into each of ``dsts`` (copy on write of a forked sample's partial block)."""
        ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int) -> None:
    """Append to ``hashes`` the chained hash of every full block of ``token_ids`` not yet hashed."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))


class KVCacheManager:
    def __init__(self, pool: BlockPool, disk: KVDiskTier | None = None, mover: BlockMover | None = None) -> None:
        """``disk`` and ``mover`` together add the disk tier below the pool."""
        self.pool = pool
        self.block_size = pool.block_size
        self.disk = disk if pool.enable_prefix_caching else None
        self.mover = mover
        self._num_inserted: dict[tuple[str, int], int] = {}  # full blocks of each sequence already in the cache
        self._num_saved: dict[tuple[str, int], int] = {}  # full blocks of each sequence already handed to the disk tier
        self._from_disk: set[bytes] = set()  # hashes read from disk and not yet counted for a request
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of which served by the cache
        self.disk_hits = 0  # of which read from the disk tier

    def _update_hashes(self, seq: Sequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size)

    def first_block_hash(self, seq: Sequence) -> bytes | None:
        """The hash of ``seq``'s first full block (None: it has none): sequences sharing a cached prefix share it."""
        self._update_hashes(seq)
        return seq.block_hashes[0] if seq.block_hashes else None

    def cached_prefix_blocks(self, token_ids: list[int]) -> list[int]:
        """Blocks that hold the cached prefix of ``token_ids`` (every full block, none locked)."""
        hashes: list[bytes] = []
        extend_block_hashes(hashes, token_ids, self.block_size)
        return self.pool.match_prefix(hashes)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of the cache that already hold a prefix of a new sequence.

        At least the last token is always recomputed, since its logits are needed, so the match
        stops at the last full block before it.
        """
        self._update_hashes(seq)
        limit = (seq.num_tokens - 1) // self.block_size
        hit = self.pool.match_prefix(seq.block_hashes[:limit])
        if self.disk is not None and len(hit) < limit and self._load_from_disk(seq.block_hashes[:limit]):
            hit = self.pool.match_prefix(seq.block_hashes[:limit])
        return hit

    def prefetch(self, token_ids: list[int]) -> int:
        """Read the disk tier's blocks of ``token_ids``' prefix into the pool ahead of a request; tokens read."""
        if self.disk is None:
            return 0
        hashes: list[bytes] = []
        extend_block_hashes(hashes, token_ids, self.block_size)
        return self._load_from_disk(hashes) * self.block_size

    def _load_from_disk(self, hashes: list[bytes]) -> int:
        """Read the blocks of the chain ``hashes`` that are on disk but not in memory into free pool blocks.

        The chain is followed as far as each block is in memory or on disk; read blocks join the
        prefix cache as free cached blocks, so the caller's next match finds them. At least one free
        block is left for the tokens to compute. Returns the number of blocks read.
        """
        assert self.disk is not None and self.mover is not None
        in_memory: list[int] = []
        on_disk: list[bytes] = []
        for block_hash in hashes:
            block = self.pool.cached.get(block_hash)
            if block is not None:
                in_memory.append(block.block_id)
            elif self.disk.contains(block_hash):
                on_disk.append(block_hash)
            else:
                break
        reused_free = sum(1 for b in in_memory if self.pool.blocks[b].ref_count == 0)
        on_disk = on_disk[: max(self.pool.num_free_blocks - reused_free - 1, 0)]
        if not on_disk:
            return 0
        self.pool.lock(in_memory)  # so that allocating cannot evict them
        ids = self.pool.allocate(len(on_disk))
        try:
            loaded = self.disk.read_chain(on_disk, self.mover.block_buffers(ids))  # the rest is computed
            self.mover.commit_blocks(ids[:loaded])
            for block_id, block_hash in zip(ids[:loaded], on_disk):
                self.pool.insert(block_id, block_hash)
                self._from_disk.add(block_hash)
        finally:
            self.pool.unlock(reversed(in_memory + ids))  # the blocks not loaded go back to the free list
        if len(self._from_disk) > self.pool.num_blocks:  # forget hashes whose blocks were evicted unused
            self._from_disk &= self.pool.cached.keys()
        return loaded

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int]) -> int:
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        new = cdiv(total, self.block_size) - len(seq.block_table) - len(computed_blocks)
        reused_free = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_count == 0)
        return max(new, 0) + reused_free

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, computed_blocks or []) <= self.pool.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> None:
        """Give ``seq`` the blocks for its next ``num_new_tokens`` tokens, adopting ``computed_blocks`` first."""
        if computed_blocks:
            self.pool.lock(computed_blocks)
            seq.block_table.extend(computed_blocks)
            seq.num_computed_tokens += len(computed_blocks) * self.block_size
        total = seq.num_computed_tokens + num_new_tokens
        new = cdiv(total, self.block_size) - len(seq.block_table)
        if new > 0:
            seq.block_table.extend(self.pool.allocate(new))

    def num_fork_blocks(self, seq: Sequence) -> int:
        """Blocks that forking ``seq``'s waiting samples takes: a copy of its partial last block for each."""
        return len(seq.forks) if seq.num_computed_tokens % self.block_size else 0

    def can_fork(self, seq: Sequence) -> bool:
        return self.num_fork_blocks(seq) <= self.pool.num_free_blocks

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Hand ``seq``'s computed prefix to each of its waiting samples and return them (``seq.forks`` empties).

        Its full blocks are shared (a reference each; their hashes and cache entries stay as they are);
        its partial last block, which each sample goes on to fill with its own tokens, is copied.
        """
        full = seq.num_computed_tokens // self.block_size
        shared = seq.block_table[:full]
        copies = self.pool.allocate(self.num_fork_blocks(seq))
        if copies:
            assert self.mover is not None, "forking a partial block needs a BlockMover to copy it"
            self.mover.copy_block(seq.block_table[full], copies)
        forks, seq.forks = seq.forks, []
        for i, fork in enumerate(forks):
            self.pool.lock(shared)
            fork.block_table = shared + copies[i : i + 1]
            fork.block_hashes = list(seq.block_hashes)  # the same prompt: the same chain
            fork.num_computed_tokens = seq.num_computed_tokens
            fork.num_cached_tokens, fork.num_disk_tokens = seq.num_cached_tokens, seq.num_disk_tokens
            self._num_inserted[fork.key] = self._num_inserted.get(seq.key, 0)
        return forks

    def record_admission(self, seq: Sequence, computed_blocks: list[int]) -> None:
        """Count a first admission towards the prefix-hit rate and the request's cached tokens."""
        seq.num_cached_tokens = len(computed_blocks) * self.block_size
        if self._from_disk:
            hashes = {self.pool.blocks[b].block_hash for b in computed_blocks}
            seq.num_disk_tokens = len(hashes & self._from_disk) * self.block_size
            self._from_disk -= hashes
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += seq.num_cached_tokens
        self.disk_hits += seq.num_disk_tokens

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s blocks past the first ``num_tokens`` tokens (they hold only refused draft tokens)."""
        keep = cdiv(num_tokens, self.block_size)
        extra, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        self.pool.unlock(reversed(extra))

    def cache_blocks(self, seq: Sequence, ahead: list[int] | None = None) -> None:
        """Put every block of ``seq`` that is now full and computed into the prefix cache; ``ahead``: tokens computed
        this step that ``seq`` appends only after it (its accepted drafts)."""
        extend_block_hashes(seq.block_hashes, seq.token_ids + ahead if ahead else seq.token_ids, self.block_size)
        done = self._num_inserted.get(seq.key, 0)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(done, full):
            self.pool.insert(seq.block_table[i], seq.block_hashes[i])
        self._num_inserted[seq.key] = max(done, full)
        if seq.key not in self._num_saved and seq.num_computed_tokens >= seq.num_prompt_tokens:
            self._save(seq, full)  # the prompt is prefilled

    def _save(self, seq: Sequence, end: int) -> None:
        """Hand ``seq``'s full blocks up to ``end`` not yet on disk to the disk tier."""
        start = self._num_saved.get(seq.key, 0)
        self._num_saved[seq.key] = max(start, end)
        if self.disk is None or end <= start:
            return
        assert self.mover is not None
        hashes = seq.block_hashes[start:end]
        todo = self.disk.missing(hashes)
        if todo:
            payloads = self.mover.gather_blocks([seq.block_table[start + i] for i in todo])
            self.disk.save([(hashes[i], payload) for i, payload in zip(todo, payloads)])

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks, tail first, so its last blocks are evicted before its prefix.

        Its computed full blocks go to the disk tier first, while their contents are still theirs.
        """
        self._save(seq, min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes)))
        self.pool.unlock(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_inserted.pop(seq.key, None)
        self._num_saved.pop(seq.key, None)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
