"""Speculative decoding's policy: which decoding sequences get draft tokens this step, how many, and the counts.

A sequence with drafts runs its last token and its k drafts as k + 1 decode rows of one step (each row
attends its own prefix over the sequence's blocks: ``ModelRunner.prepare``), the sampler picks a token at
every row, and the drafts are accepted up to the first that differs from the token picked before it;
that token comes too, so a step yields 1 to k + 1 tokens and greedy output is the output without drafts.
Sampled rows draw from the target's distribution at each row, and a draft is kept where the draw equals
it, which is rejection sampling for a draft that is one token for sure: the reply's distribution is the
target's. The rows past the first mismatch are thrown away: the scheduler counts only the kept tokens
as computed and gives back the blocks past them (``Scheduler.on_step_done``).

Drafts come from a draft model (``engine.draft``: a smaller model of the same vocabulary, "draft"), or from
n-gram lookup (``engine.proposer``) in the sequence's own prompt and reply ("ngram"),
and also in what the engine generated for earlier requests ("suffix": a regenerated reply repeats an
earlier one). Each sequence adapts its k: it grows while drafts are taken whole and falls to what was
taken, and a sequence whose drafts keep missing waits a while before it proposes again. Not every request
speculates: a grammar, penalties or bias (their logits depend on the tokens before each row, which the
batched sampler reads from the sequence) and a seeded sampled request (its stream must not depend on what
else runs) decode one token a step. "auto" speculates with the suffix proposer while a step's decode rows,
drafts included, stay within ``AUTO_MAX_ROWS``: on the CPU the native matmul multiplies up to four rows
straight from the packed weights, and past that it unpacks a panel first, so a fifth row costs about
as much as the step did (``benchmarks/spec_decode.py`` measures the engine with and without drafts).

A draft model's drafts are computed only once the step's blocks are allocated, since it writes its own K/V
at the drafts' positions: ``drafts`` returns ``PENDING`` slots, counted by the scheduler like any drafts, and
the model runner has the draft model fill them before the step runs (as vLLM v1's model runner runs its
drafter). The draft model proposes up to the user's k a step and adapts it as the n-gram drafts do. Its drafts also
cost time, which n-gram lookups do not: each step pays the draft's forwards on top of the target's. So a draft
model's steps are timed whole (``step_timed``), and the tokens a second of steps with drafts yield are weighed
against those of steps without, of as many sequences: where ``COST_STEPS`` drafted steps yielded fewer, the
draft model rests ``PAUSE_STEPS`` steps, longer each time it still does not pay, then tries again (a few steps
without drafts are taken first where none of that size were timed yet). A draft as slow as its target so
drafts about 4 steps in 70 at first, and fewer while it keeps losing.
"""

from __future__ import annotations

from dataclasses import dataclass

from localpaged.engine.proposer import History, NgramIndex, NgramProposer
from localpaged.engine.sequence import Sequence

K_START = 3  # drafts a sequence proposes at first
K_MAX = 3  # the most a sequence proposes in a step: with its own token, the CPU matmul's four direct rows
# "auto": a step's decode rows at most, drafts included. On the CPU, the native matmul's direct rows; on a GPU a
# decode step is bound by reading weights well past this (not yet measured here).
AUTO_MAX_ROWS = {"cpu": 4, "gpu": 16}
MAX_IDLE = 16  # steps a sequence whose drafts keep missing waits, at most, before it proposes again
OWN_NGRAMS = (2, 4)  # n-gram sizes looked up in a sequence's own tokens
HISTORY_NGRAMS = (3, 8)  # and in the engine's history: longer, since it holds many requests' text
PENDING = -1  # a draft slot the draft model fills once the step's blocks are allocated (engine.draft)
PAUSE_STEPS = (64, 1024)  # a draft model that does not pay rests this many steps at first, doubling up to the last
COST_STEPS = 4  # drafted steps whose times decide whether a draft model pays
PLAIN_STEPS = 4  # steps without drafts timed before the first verdict, and the recent ones it weighs (x4, halved)


@dataclass
class SpecState:
    """One sequence's speculation: its n-gram index, its current k, and how long it waits after misses."""

    index: NgramIndex | None  # None for a draft model's drafts
    k: int = K_START
    misses: int = 0  # steps in a row whose drafts were all refused
    idle: int = 0  # steps left before it proposes again
    draft_computed: int = 0  # tokens whose K/V the draft model holds in the sequence's blocks (engine.draft)
    draft_preemptions: int = 0  # the sequence's preemptions when it last caught up (a preempted one starts over)


@dataclass
class StepTimes:
    """Timed decode steps, summed: their count, the tokens they yielded and their seconds."""

    steps: float = 0
    tokens: float = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class Speculator:
    """Drafts for the scheduler (an engine with speculation off has none), and the counts of proposed and accepted
    draft tokens for the engine's stats."""

    def __init__(self, mode: str, max_rows: int | None = None, k: int | None = None) -> None:
        """``mode``: "ngram", "suffix" or "draft"; ``max_rows``: a step's decode rows at most, drafts included (None:
        any); ``k``: the most drafts a sequence proposes a step (default ``K_MAX``), where it starts too with
        "draft"."""
        self.max_rows = max_rows
        self.k_max = k or K_MAX
        self.model_drafts = mode == "draft"
        self.k_start = self.k_max if self.model_drafts else K_START
        self.own = NgramProposer(self.k_max, *OWN_NGRAMS)
        self.history = History(*HISTORY_NGRAMS) if mode == "suffix" else None
        self.num_proposed = 0
        self.num_accepted = 0
        # Whether a draft model's steps are weighed (``step_timed``): its drafts take time, n-gram lookups next to
        # none. The tests of batched drafts from the target itself (a draft that never pays) switch it off.
        self.weighs_cost = self.model_drafts
        self.paused = 0  # steps left without drafts
        self.pause = PAUSE_STEPS[0]  # the next rest's length
        self._drafted: dict[int, StepTimes] = {}  # by the step's sequences: drafted steps since the last verdict
        self._plain: dict[int, StepTimes] = {}  # and recent steps without drafts

    @staticmethod
    def takes(seq: Sequence) -> bool:
        """Whether ``seq``'s sampling lets its drafts be checked in one step (see the module docstring)."""
        p = seq.params
        return p.structured is None and not p.penalized and (p.greedy or p.seed is None)

    def spare_rows(self, num_decodes: int) -> int:
        """How many draft tokens a step with ``num_decodes`` decoding sequences may take in all (called once a step)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k_max * num_decodes if self.max_rows is None else max(self.max_rows - num_decodes, 0)

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        """Up to ``room`` draft tokens for ``seq``'s next step ([] when it should decode one token)."""
        if room <= 0 or not self.takes(seq):
            return []
        state: SpecState | None = seq.spec
        if state is None:
            state = seq.spec = SpecState(None if self.model_drafts else self.own.index(), k=self.k_start)
        if state.idle:
            state.idle -= 1
            return []
        k = min(state.k, room)
        if self.model_drafts:
            return [PENDING] * k
        drafts, n = self.own.propose(seq.token_ids, k, state.index)
        if self.history is not None:
            earlier, m = self.history.propose(seq.token_ids, k, at_least=n + 1)
            if m > n:
                drafts = earlier
        return drafts

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Count a step's check of ``proposed`` (> 0) drafts of which the first ``accepted`` were kept, and adapt k."""
        self.num_proposed += proposed
        self.num_accepted += accepted
        state: SpecState = seq.spec
        if accepted == proposed:
            state.k = min(state.k * 2, self.k_max)
        else:
            state.k = accepted + 1
        if accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.idle = min(2 ** (state.misses - 1) - 1, MAX_IDLE)

    def step_timed(self, num_seqs: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        """Weigh a decode step of ``num_seqs`` sequences, with drafts or without, that yielded ``num_tokens`` in
        ``seconds``; after ``COST_STEPS`` drafted steps of that many sequences, a draft model that did not pay
        rests (see the module docstring)."""
        if not self.weighs_cost:
            return
        plain = self._plain.setdefault(num_seqs, StepTimes())
        if not drafted:
            if plain.steps >= 4 * PLAIN_STEPS:  # the recent steps count most
                plain.steps, plain.tokens, plain.seconds = plain.steps / 2, plain.tokens / 2, plain.seconds / 2
            plain.add(num_tokens, seconds)
            return
        times = self._drafted.setdefault(num_seqs, StepTimes())
        times.add(num_tokens, seconds)
        if times.steps < COST_STEPS:
            return
        if plain.steps < PLAIN_STEPS:  # nothing to weigh them against yet: a few steps without drafts
            self.paused = PLAIN_STEPS
            return
        del self._drafted[num_seqs]
        if times.rate() > plain.rate():
            self.pause = PAUSE_STEPS[0]
        else:
            self.paused, self.pause = self.pause, min(self.pause * 2, PAUSE_STEPS[1])

    def finished(self, seq: Sequence) -> None:
        """Remember a finished sequence's reply, after the prompt tokens that led to it, for later requests."""
        if self.history is not None and seq.num_output_tokens:
            self.history.add(seq.token_ids[max(seq.num_prompt_tokens - HISTORY_NGRAMS[1], 0) :])
