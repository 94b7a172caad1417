"""One request's state as the scheduler and the pool see it: tokens, block table, progress, timings.

No torch here, so the pool and scheduler test fast. Tokens are ``prompt + output`` in one list;
``num_computed_tokens`` counts those whose K/V are in the pool (from the prefix cache or computed),
and the scheduler moves it forward a chunk at a time.

A request for ``n`` > 1 samples is n Sequences of one ``request_id``, told apart by ``index``: sample 0
is queued and prefills the prompt but its last token, holding the others in ``forks``; then the
scheduler forks them off it (they share its full blocks and copy its partial one) and each computes
the last prompt token itself and samples on, a sequence like any other from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from localpaged.engine.output import FinishReason


class SequenceStatus(Enum):
    WAITING = "waiting"
    WAITING_FOR_FSM = "waiting_for_fsm"  # queued while its grammar compiles (vLLM's name); admission skips it
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the queues find and remove a sequence by itself, not by its fields
class Sequence:
    request_id: str
    token_ids: list[int]
    params: Any  # SamplingParams; typed loosely so this module stays free of torch
    arrival: int = 0  # admission order: FCFS, and newest-first preemption
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, in order
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_disk_tokens: int = 0  # of which read from the disk tier
    num_preemptions: int = 0
    num_passes: int = 0  # times admission took a later request that joins a running group first (scheduler)
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    extra: Any = None  # per-sample state owned by the engine (detokenizer, generator)
    index: int = 0  # which of its request's samples this is
    forks: list[Sequence] = field(default_factory=list)  # samples waiting to fork off this one (see above)
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft tokens (engine.speculative)
    spec: Any = None  # its speculation state, owned by the Speculator

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def key(self) -> tuple[str, int]:
        """Unique among the sequences in flight: the request and the sample."""
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens it may compute now: all uncomputed ones, but the last prompt token while forks wait."""
        return self.num_uncomputed_tokens - (1 if self.forks else 0)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
