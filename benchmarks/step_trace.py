"""Run requests to completion on an LLM's own step loop and record what every step did.

For each step: its wall time, the sequences and tokens it ran, the pool's used blocks just after it
was scheduled (the most a step holds: its tokens' blocks are allocated and those of the sequences it
finishes not yet freed) and the tokens whose KV each live sequence holds once it is done. For each
request: when its first token came. The scheduler's ``schedule`` is wrapped for the length of the
run to see each batch; nothing else about the engine changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    start: float
    end: float
    seqs: int  # sequences the step ran
    tokens: int  # tokens it computed
    used_blocks: int  # the pool's used blocks just after scheduling
    held: list[int]  # tokens each running sequence holds once the step is done

    @property
    def decode_only(self) -> bool:
        return self.tokens == self.seqs


@dataclass
class Trace:
    start: float  # just before the first request was added
    request_ids: list[str]  # in the order of the prompts
    first_token: dict[str, float] = field(default_factory=dict)  # request id -> time of its first token
    token_counts: dict[str, int] = field(default_factory=dict)  # request id -> tokens it produced
    steps: list[StepRecord] = field(default_factory=list)
    preemptions: int = 0

    def ttfts(self) -> list[float]:
        """Each request's time to first token from the common start, in the order of the prompts."""
        return [self.first_token[r] - self.start for r in self.request_ids]


def run_traced(llm, prompts: list[list[int]], params) -> Trace:
    """Add every prompt at once, step until all finish; a failed request raises (a benchmark measures none)."""
    scheduler = llm.scheduler
    schedule = scheduler.schedule
    pending: list[tuple[int, int, int, list[int]]] = []  # what the wrapped schedule saw, for the step's record

    def schedule_and_look():
        batch = schedule()
        scheduled = {id(s): n for s, n in zip(batch.seqs, batch.num_new_tokens)}
        held = [s.num_computed_tokens + scheduled.get(id(s), 0) for s in scheduler.running]
        pending.append((len(batch.seqs), batch.num_tokens, llm.pool.num_used_blocks, held))
        return batch

    preemptions = scheduler.num_preemptions
    scheduler.schedule = schedule_and_look
    try:
        trace = Trace(time.perf_counter(), [])
        trace.request_ids = [llm.add_request(p, params) for p in prompts]
        while llm.has_unfinished_requests():
            start = time.perf_counter()
            outputs = llm.step()
            end = time.perf_counter()
            for out in outputs:
                if out.error:
                    raise RuntimeError(out.error)
                trace.first_token.setdefault(out.request_id, end)
                trace.token_counts[out.request_id] = len(out.token_ids)
            if pending and pending[-1][0]:  # a step that scheduled nothing ran nothing
                trace.steps.append(StepRecord(start, end, *pending.pop()))
            pending.clear()
    finally:
        del scheduler.schedule  # the class's method again
    trace.preemptions = scheduler.num_preemptions - preemptions
    return trace
