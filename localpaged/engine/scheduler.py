"""Continuous batching: which sequences run this step, and how many of their tokens.

One token budget per step covers prefill and decode alike (as in vLLM v1). Running decodes are
served first, then running prefills continue chunk by chunk, then waiting requests are admitted
first come, first served. A long prompt therefore never stalls the decodes: it takes what budget
is left. When the pool runs dry, the newest running sequence is preempted: its blocks go back
(staying in the prefix cache) and it is recomputed later.

Admission keeps shared-prefix groups together where that costs nothing: if the first waiting request
shares no running sequence's first block but one of the next few does, that one goes first (it joins
its group's shared-prefix attention, and most of its prompt is cached). A request passed over
``MAX_PASSES`` times goes first regardless, and a preempted one is never passed over, so none starves.

Parallel samples (``n`` > 1, see engine.sequence): a request's first sample is admitted with room for all
n in ``max_num_seqs``, prefills its prompt but the last token once, and at the start of the next step its
samples fork off it (the pool permitting, else the newest running sequence is preempted, as for a decode);
then all n compute the last prompt token as decode rows. A sample that is preempted later is recomputed
alone, its prompt mostly from the prefix cache its siblings keep warm.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from localpaged.engine.kv_cache_manager import KVCacheManager
from localpaged.engine.sequence import Sequence, SequenceStatus

LOOKAHEAD = 8  # waiting requests admission looks at for one that joins a running group
MAX_PASSES = 4  # times a request may be passed over for such a one


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = self._fork_ready()
        decodes_first = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival))
        for seq in decodes_first:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_schedulable_tokens, budget)
            while not self.kv.can_allocate(seq, n):
                victim = max(self.running, key=lambda s: (s.arrival, s.index))
                self.preempt(victim)
                preempted = True
                if victim in seqs:  # scheduled earlier in this step: take it back out
                    i = seqs.index(victim)
                    budget += counts.pop(i)
                    seqs.pop(i)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.kv.allocate(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self._next_admission()
            if seq is None:  # every waiting request's grammar is still compiling
                break
            if seq.forks and len(self.running) + 1 + len(seq.forks) > self.max_num_seqs:
                break  # its samples will need the room
            computed = self.kv.get_computed_blocks(seq)
            n = min(seq.num_schedulable_tokens - len(computed) * self.kv.block_size, budget)
            if not self.kv.can_allocate(seq, n, computed):
                break
            self.waiting.remove(seq)
            if seq.num_preemptions == 0:
                self.kv.record_admission(seq, computed)
            self.kv.allocate(seq, n, computed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if n == 0:
                continue  # a first sample whose prompt is cached but the last token: it forks next step
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def _fork_ready(self) -> bool:
        """Fork the samples of every running first sample that has computed its prompt but the last token,
        preempting the newest running sequences where the pool lacks their partial block's copies;
        whether any was preempted."""
        preempted = False
        for seq in [s for s in self.running if s.forks and s.num_schedulable_tokens == 0]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier one
            while not self.kv.can_fork(seq):
                victim = max(self.running, key=lambda s: (s.arrival, s.index))
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            for fork in self.kv.fork(seq):
                fork.arrival = seq.arrival
                fork.status = SequenceStatus.RUNNING
                self.running.append(fork)
        return preempted

    def _next_admission(self) -> Sequence | None:
        """The first waiting request, or the first of the next LOOKAHEAD - 1 that shares a running sequence's first
        block where the first shares none (each request it passes counts one pass; see the module docstring).
        Requests whose grammar still compiles are skipped (None when every one is)."""
        ready = list(islice((s for s in self.waiting if s.status is SequenceStatus.WAITING), LOOKAHEAD))
        if not ready:
            return None
        head = ready[0]
        if head.num_passes >= MAX_PASSES or head.num_preemptions or not self.running:
            return head
        running = {s.block_hashes[0] for s in self.running if s.block_hashes}
        if not running or self.kv.first_block_hash(head) in running:
            return head
        for i, seq in enumerate(ready[1:], start=1):
            if seq.num_preemptions == 0 and self.kv.first_block_hash(seq) in running:
                for passed in ready[:i]:
                    passed.num_passes += 1
                return seq
        return head

    def preempt(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back and queue it first for recompute."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stopped, aborted or failed) and free its blocks at once; samples still waiting to
        fork off it end with it."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.WAITING_FOR_FSM):
            self.waiting.remove(seq)
        if seq.block_table:
            self.kv.free(seq)
        for ended in [seq, *seq.forks]:
            ended.status = SequenceStatus.FINISHED
            ended.finish_reason = reason
        seq.forks = []

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Advance each scheduled sequence past the tokens computed this step and cache its full blocks."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.kv.cache_blocks(seq)
