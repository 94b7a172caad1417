"""Sequence-level use of the block pool: prefix hits at admission, slots for new tokens, caching, freeing.

The scheduler speaks in sequences and token counts; this turns that into pool operations, as
vLLM v1's KVCacheManager does. Verbs come in pairs: ``can_allocate``/``allocate``, ``free``.
"""

from __future__ import annotations

from localpaged.engine.block_pool import BlockPool, hash_block
from localpaged.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, salt: bytes = b"") -> None:
    """Append to ``hashes`` the chained hash of every full block of ``token_ids`` not yet hashed."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt))


class KVCacheManager:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._num_inserted: dict[str, int] = {}  # full blocks of each sequence already in the cache
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of which served by the cache

    def _update_hashes(self, seq: Sequence) -> None:
        salt = getattr(seq.params, "cache_salt", b"") or b""
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, salt)

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
        return self.pool.match_prefix(seq.block_hashes[:limit])

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

    def record_admission(self, seq: Sequence, computed_blocks: list[int]) -> None:
        """Count a first admission towards the prefix-hit rate and the request's cached tokens."""
        seq.num_cached_tokens = len(computed_blocks) * self.block_size
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += seq.num_cached_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Put every block of ``seq`` that is now full and computed into the prefix cache."""
        self._update_hashes(seq)
        done = self._num_inserted.get(seq.request_id, 0)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(done, full):
            self.pool.insert(seq.block_table[i], seq.block_hashes[i])
        self._num_inserted[seq.request_id] = max(done, full)

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks, tail first, so its last blocks are evicted before its prefix."""
        self.pool.unlock(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_inserted.pop(seq.request_id, None)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
