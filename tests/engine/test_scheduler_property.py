"""Pool + scheduler under random load: arrivals, aborts, shared prefixes, and a pool small enough to preempt.

The "model" here reads each sequence's context back out of a simulated KV cache through its block
table and hashes it into the next token. A block table pointing at the wrong block, a shared block
overwritten, or a prefix hit on the wrong content therefore changes the output, which must equal
the same hash over the true token history.

With a simulated disk tier below the pool, blocks leave for "disk" as their bytes (the slots'
tokens) and come back into other pool blocks; the disk is small enough to lose blocks (LRU) and
some of its files are unreadable (a miss, as a corrupt file is), so chains break anywhere.

Requests for several samples fork off their first sample (engine.sequence); each sample's "model"
hashes its index in too, so samples differ, and a forked sample reading a sibling's partial block
(a copy on write gone wrong) or a block its fork did not copy changes its output.

With speculation, each decoding sequence gets drafts of random length, its true next tokens with some
spoiled, checked row by row as the runner does (engine.speculative): refused drafts' slots, blocks given
back past what was kept, and accepted drafts' blocks in the prefix cache must all leave the outputs
as they are without drafts.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged.engine.block_pool import BlockPool
from localpaged.engine.kv_cache_manager import KVCacheManager, extend_block_hashes
from localpaged.engine.scheduler import Scheduler
from localpaged.engine.sequence import Sequence

BS = 4
VOCAB = 7


def next_token(context: list[int], index: int = 0) -> int:
    return hashlib.sha256(str((index, context)).encode()).digest()[0] % VOCAB


def unconstrained(prompt: list[int], max_tokens: int, index: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, index))
    return tokens[len(prompt) :]


def samples(rid: str, prompt: list[int], max_tokens: int, n: int) -> list[Sequence]:
    """A request's ``n`` samples as the engine queues them: the first, holding the others as its forks."""
    seqs = [Sequence(rid, list(prompt), Params(max_tokens), index=i) for i in range(n)]
    seqs[0].forks = seqs[1:]
    return seqs


@dataclass
class Params:
    max_tokens: int


class SimulatedDisk:
    """The disk tier's interface over a dict of ``capacity`` blocks (least recently used go first);
    a block whose hash's first byte is divisible by ``unreadable`` reads as a corrupt file: deleted, a miss."""

    def __init__(self, capacity: int, unreadable: int) -> None:
        self.files: OrderedDict[bytes, bytes] = OrderedDict()
        self.capacity = capacity
        self.unreadable = unreadable
        self.reads = 0

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.files

    def read_chain(self, block_hashes: list[bytes], buffers: list[list[memoryview]]) -> int:
        for i, (block_hash, block_buffers) in enumerate(zip(block_hashes, buffers)):
            if not self.read_into(block_hash, block_buffers):
                return i
        return len(block_hashes)

    def read_into(self, block_hash: bytes, buffers: list[memoryview]) -> bool:
        if block_hash not in self.files or block_hash[0] % self.unreadable == 0:
            self.files.pop(block_hash, None)
            buffers[0][:] = bytes(len(buffers[0]))  # as the tier zeroes a block it could not read
            return False
        self.files.move_to_end(block_hash)
        self.reads += 1
        buffers[0][:] = self.files[block_hash]
        return True

    def missing(self, block_hashes: list[bytes]) -> list[int]:
        return [i for i, h in enumerate(block_hashes) if h not in self.files]

    def save(self, blocks: list[tuple[bytes, memoryview]]) -> None:
        for block_hash, payload in blocks:
            self.files[block_hash] = bytes(payload)
            self.files.move_to_end(block_hash)
        while len(self.files) > self.capacity:
            self.files.popitem(last=False)


class RandomDrafts:
    """The Speculator's interface: each decoding sequence's true next tokens (from ``expected``), a random number
    of them, each spoiled with probability ``spoil``."""

    def __init__(self, seed: int, expected: dict[tuple[str, int], list[int]], spoil: float = 0.3) -> None:
        self.rng = random.Random(seed)
        self.expected = expected
        self.spoil = spoil
        self.checked: list[tuple[int, int]] = []  # (proposed, accepted) of every step's check

    def spare_rows(self, num_decodes: int) -> int:
        return self.rng.randint(0, 5 * num_decodes)

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        done = seq.num_output_tokens
        true = self.expected[seq.key][done : done + self.rng.randint(0, max(min(room, 5), 0))]
        return [(t + 1) % VOCAB if self.rng.random() < self.spoil else t for t in true]

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.checked.append((proposed, accepted))

    def finished(self, seq: Sequence) -> None:
        pass


class FakeEngine:
    def __init__(
        self,
        num_blocks: int,
        max_num_seqs: int,
        budget: int,
        disk: SimulatedDisk | None = None,
        speculator: RandomDrafts | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks, BS)
        self.kv = KVCacheManager(self.pool, disk, self)
        self.scheduler = Scheduler(self.kv, max_num_seqs, budget, speculator)
        self.slots = [None] * (num_blocks * BS)
        self.staged: list[bytearray] = []  # what block_buffers handed out, until commit_blocks
        self.finished: dict[tuple[str, int], list[int]] = {}
        self.copies = 0  # partial blocks copied for forks

    # A block's bytes: its BS slots as int32, -1 for a slot never written.
    def gather_blocks(self, block_ids: list[int]) -> list[memoryview]:
        return [
            memoryview(array("i", [-1 if t is None else t for t in self.slots[b * BS : (b + 1) * BS]]))
            for b in block_ids
        ]

    def block_buffers(self, block_ids: list[int]) -> list[list[memoryview]]:
        self.staged = [bytearray(BS * 4) for _ in block_ids]
        return [[memoryview(buffer)] for buffer in self.staged]

    def commit_blocks(self, block_ids: list[int]) -> None:
        for b, buffer in zip(block_ids, self.staged):
            self.slots[b * BS : (b + 1) * BS] = [None if t == -1 else t for t in array("i", buffer)]

    def copy_block(self, src: int, dsts: list[int]) -> None:
        for dst in dsts:
            self.slots[dst * BS : (dst + 1) * BS] = self.slots[src * BS : (src + 1) * BS]
            self.copies += 1

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BS] * BS + pos % BS

    def step(self) -> None:
        """Write the step's tokens (drafts too) into their slots, then pick a token at every row with logits: the
        last token's, and each draft's over the context up to it; keep the drafts up to the first mismatch."""
        batch = self.scheduler.schedule()
        new: dict[int, list[int]] = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            tokens = seq.token_ids + seq.spec_token_ids
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.slots[self.slot(seq, p)] = tokens[p]
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            drafts = seq.spec_token_ids
            if seq.num_computed_tokens + n == seq.num_tokens + len(drafts):
                kept: list[int] = []
                for j in range(len(drafts) + 1):
                    context = [self.slots[self.slot(seq, p)] for p in range(seq.num_tokens + j)]
                    kept.append(next_token(context, seq.index))
                    if j == len(drafts) or kept[-1] != drafts[j]:
                        break
                new[i] = kept
        self.scheduler.on_step_done(batch, [len(new[i]) - 1 if i in new else 0 for i in range(len(batch.seqs))])
        for i, tokens in new.items():
            seq = batch.seqs[i]
            for token in tokens:
                seq.append_token(token)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.scheduler.finish(seq, "length")
                    self.finished[seq.key] = seq.output_token_ids
                    break

    def check(self) -> None:
        self.pool.check_integrity()
        refs = sum(b.ref_count for b in self.pool.blocks)
        held = sum(len(s.block_table) for s in self.scheduler.running)
        assert refs == held, "ref counts must equal the blocks the running sequences hold"
        assert all(not s.block_table for s in self.scheduler.waiting)
        for s in self.scheduler.running:
            assert len(s.block_table) * BS >= s.num_computed_tokens
            assert s.num_disk_tokens <= s.num_cached_tokens
            chain: list[bytes] = []  # a block's hash is its own tokens' (never a refused draft's)
            extend_block_hashes(chain, s.token_ids, BS)
            assert s.block_hashes == chain[: len(s.block_hashes)]


prefixes = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=13)
request = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),  # own tail
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # arrives after this many steps since the previous one
    st.booleans() | st.just(False),  # aborted a few steps after arrival
    st.integers(1, 4),  # samples (n), at most max_num_seqs
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared=st.lists(prefixes, min_size=3, max_size=3),
    requests=st.lists(request, min_size=1, max_size=12),
    num_blocks=st.integers(9, 24),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    disk=st.none() | st.builds(SimulatedDisk, st.integers(1, 30), st.integers(2, 9)),
    speculate=st.none() | st.integers(0, 2**32),
)
def test_random_load_keeps_invariants_and_outputs(shared, requests, num_blocks, max_num_seqs, budget, disk, speculate):
    expected: dict[tuple[str, int], list[int]] = {}
    drafts = RandomDrafts(speculate, expected) if speculate is not None else None
    engine = FakeEngine(num_blocks, max_num_seqs, budget, disk, drafts)
    aborts, pending, queued = {}, list(enumerate(requests)), {}
    step = wait = 0
    while pending or engine.scheduler.has_unfinished():
        while pending and wait >= pending[0][1][3]:
            i, (which, tail, max_tokens, _, abort, n) = pending.pop(0)
            n = min(n, max_num_seqs)
            prompt = (shared[which] + tail)[: (num_blocks - 3) * BS - max_tokens]  # one request always fits
            if not prompt:
                prompt = tail[:1]
            rid = f"r{i}"
            if disk is not None and i % 2:
                engine.kv.prefetch(prompt)  # as the app does when a stored chat is opened
                engine.check()
            queued[rid] = samples(rid, prompt, max_tokens, n)
            engine.scheduler.add(queued[rid][0])
            for index in range(n):
                expected[(rid, index)] = unconstrained(prompt, max_tokens, index)
            if abort:
                aborts[rid] = step + 2
            wait = 0
        for rid, at in list(aborts.items()):
            if step >= at:
                del aborts[rid]
                for seq in queued[rid]:  # as LLM.abort: the first sample first, its waiting forks end with it
                    if not seq.is_finished:
                        engine.scheduler.finish(seq, "abort")
                    if seq.key not in engine.finished:
                        expected.pop(seq.key)
        engine.step()
        engine.check()
        step += 1
        wait += 1
        assert step < 5000, "the scheduler stopped making progress"
    for key, want in expected.items():
        assert engine.finished.get(key) == want, f"{key} produced the wrong tokens"
    assert engine.pool.num_used_blocks == 0


def test_samples_share_the_prompt_full_blocks_and_copy_its_partial_one():
    engine = FakeEngine(num_blocks=16, max_num_seqs=4, budget=64)
    prompt = list(range(10))  # 9 tokens prefilled by the first sample: 2 full blocks and 1 token of a third
    first, *forks = samples("r", prompt, 3, 3)
    engine.scheduler.add(first)
    engine.step()
    assert first.num_computed_tokens == 9 and not first.output_token_ids  # the last prompt token waits
    assert engine.pool.num_used_blocks == 3
    engine.step()  # forks, then all three compute the last prompt token and sample
    assert engine.copies == 2
    assert all(s.block_table[:2] == first.block_table[:2] for s in forks)
    assert len({s.block_table[2] for s in [first, *forks]}) == 3
    assert [engine.pool.blocks[b].ref_count for b in first.block_table[:2]] == [3, 3]
    assert engine.pool.num_used_blocks == 5
    engine.check()
    while engine.scheduler.has_unfinished():
        engine.step()
        engine.check()
    assert engine.finished == {("r", i): unconstrained(prompt, 3, i) for i in range(3)}
    assert engine.pool.num_used_blocks == 0
