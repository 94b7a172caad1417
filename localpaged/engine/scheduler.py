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
from localpaged.engine.speculative import Speculator

LOOKAHEAD = 8  # waiting requests admission looks at for one that joins a running group
MAX_PASSES = 4  # times a request may be passed over for such a one


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step, its draft tokens among them

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculator: Speculator | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """``speculator``: draft tokens for decoding sequences, none past ``max_model_len`` tokens."""
        self.kv = kv
        self.speculator = speculator
        self.max_model_len = max_model_len
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
        num_decodes = sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        spare = self.speculator.spare_rows(num_decodes) if self.speculator is not None else 0
        for seq in decodes_first:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            seq.spec_token_ids = self._drafts(seq, min(budget - 1, spare))
            spare -= len(seq.spec_token_ids)
            n = min(seq.num_schedulable_tokens, budget) + len(seq.spec_token_ids)
            while not self.kv.can_allocate(seq, n):
                if seq.spec_token_ids:  # drafts go before anyone is preempted
                    n -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
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
            seq.spec_token_ids = []
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

    def _drafts(self, seq: Sequence, room: int) -> list[int]:
        """At most ``room`` draft tokens for a decoding ``seq`` (engine.speculative), within its max_tokens and the
        context; [] for a sequence with more than its last token to compute."""
        if self.speculator is None or seq.num_uncomputed_tokens != 1 or seq.forks:
            return []
        room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens - 1)
        return self.speculator.drafts(seq, room)

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
        seq.spec_token_ids = []
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
        if self.speculator is not None and reason != "error":
            self.speculator.finished(seq)
        for ended in [seq, *seq.forks]:
            ended.status = SequenceStatus.FINISHED
            ended.finish_reason = reason
        seq.forks = []

    def on_step_done(self, batch: ScheduledBatch, accepted: list[int] | None = None) -> None:
        """Advance each scheduled sequence past the tokens computed this step and cache its full blocks.

        ``accepted[i]``: how many of sequence i's draft tokens were kept (those and the token it ran before them
        count as computed; the blocks past them go back, holding only refused drafts, never cached).
        """
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            kept = accepted[i] if accepted is not None and drafts else 0
            seq.num_computed_tokens += n - (len(drafts) - kept)
            if drafts:
                self.speculator.verified(seq, len(drafts), kept)
                self.kv.truncate(seq, seq.num_computed_tokens + 1)
            self.kv.cache_blocks(seq, drafts[:kept])
