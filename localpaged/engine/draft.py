"""A draft model for speculative decoding: a smaller model of the target's vocabulary proposes each step's drafts.

It runs in the core process beside the target, on the target's code: a ``ModelRunner`` of its own holds its
K/V and binds its attention, and its steps take the same paths (the torch path for prefills, the native CPU
decode step for one-token rows). Its K/V tensors are indexed by the target's block ids, so the pool's block
tables serve both and a block costs the target's bytes plus the draft's (``engine.setup`` sizes the pool by
the sum): the pool, the scheduler and the prefix cache know nothing of the draft.

``SpecState.draft_computed`` counts a sequence's tokens whose draft K/V are in its blocks. It starts at 0
for every sequence, and again after a preemption: prefix-cache and disk blocks were filled by the target,
and their draft K/V may be another sequence's or nothing, so the draft catches up by a prefill of its own
(in chunks of the step's token budget). Catching up rewrites the draft K/V of blocks other sequences share
with the same tokens' values; a draft's K/V only ever decides what is proposed, never what is kept.

To propose k drafts for a sequence of L tokens the draft computes its tokens from ``draft_computed`` to L - 1
(the last row's token is draft 1), then k - 1 greedy one-token steps, each batched over the step's
sequences: draft j - 1 at position L + j - 2 gives draft j. Those K/V land in the slots the scheduler
allocated for the target's rows, in the draft's own tensors. After the step the target has kept some drafts
and computed ``num_computed_tokens``; the draft K/V before that position are of kept tokens, so
``draft_computed`` falls to it at the next proposal (the blocks past it were given back).
"""

from __future__ import annotations

import torch

from localpaged.engine.runner import ModelRunner
from localpaged.engine.sampler import greedy_indices
from localpaged.engine.scheduler import ScheduledBatch
from localpaged.engine.sequence import Sequence
from localpaged.engine.speculative import PENDING, SpecState

DECODE_ROWS = 4  # a catch-up of at most this many tokens a sequence runs as decode rows (``DraftModel._step``)


class DraftModel:
    """Fills the draft slots (``speculative.PENDING``) of a batch's sequences with the draft model's greedy tokens."""

    def __init__(self, runner: ModelRunner, vocab_size: int, max_tokens: int) -> None:
        """``runner``: the draft model with its K/V over the target's blocks; ``vocab_size``: the target's, which the
        drafts stay below (a draft's embedding may have more padding rows); ``max_tokens``: a catch-up forward's
        tokens at most (the engine's token budget)."""
        self.runner = runner
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        # Whether the last ``propose`` prefilled a sequence the draft had not seen (a new chat, a preempted one, one
        # back from a rest): a cost paid once, which the speculator leaves out when it weighs a step's drafts.
        self.prefilled = False

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Replace the pending drafts of ``batch``'s sequences with the draft model's."""
        seqs = [s for s in batch.seqs if s.spec_token_ids and s.spec_token_ids[0] == PENDING]
        if not seqs:
            return
        drafts = [[token] for token in self._catch_up(seqs)]
        for j in range(1, max(len(s.spec_token_ids) for s in seqs)):
            rows = [i for i, s in enumerate(seqs) if len(s.spec_token_ids) > j]
            entries = [(seqs[i], seqs[i].num_tokens - 1 + j, [drafts[i][-1]]) for i in rows]
            for i, token in zip(rows, self._step(entries)):
                drafts[i].append(token)
        for seq, own in zip(seqs, drafts):
            seq.spec_token_ids = own
            state: SpecState = seq.spec
            state.draft_computed = seq.num_tokens + len(own) - 1

    def _catch_up(self, seqs: list[Sequence]) -> list[int]:
        """Compute each sequence's tokens the draft lacks, up to its last, in forwards of at most ``max_tokens``
        tokens; the draft's greedy token after each sequence's last."""
        starts = []
        for seq in seqs:
            state: SpecState = seq.spec
            if state.draft_preemptions != seq.num_preemptions:  # new blocks: none holds this draft's K/V
                state.draft_preemptions, state.draft_computed = seq.num_preemptions, 0
            starts.append(min(state.draft_computed, seq.num_computed_tokens))
        self.prefilled = any(seq.num_tokens - start > DECODE_ROWS for start, seq in zip(starts, seqs))
        firsts = [PENDING] * len(seqs)
        while any(start < seq.num_tokens for start, seq in zip(starts, seqs)):
            budget = self.max_tokens
            chunks: list[int] = []  # the sequences in this forward
            entries = []
            for i, seq in enumerate(seqs):
                n = min(seq.num_tokens - starts[i], budget)
                if n > 0:
                    chunks.append(i)
                    entries.append((seq, starts[i], seq.token_ids[starts[i] : starts[i] + n]))
                    starts[i] += n
                    budget -= n
            for i, token in zip(chunks, self._step(entries)):
                firsts[i] = token  # the last chunk's is the one after the sequence's last token
        return firsts

    def _step(self, entries: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        """One forward of the draft over ``entries`` (a sequence, the position of its first token, the tokens);
        the greedy token after each entry's last.

        Where no entry has more than ``DECODE_ROWS`` tokens, each token is a decode row of its own (as the target
        checks drafts: row p attends the first p + 1 tokens), so the step takes the decode path (the native decode
        step on the CPU) rather than a prefill's: after a step that kept every draft the draft lacks two tokens.
        """
        bs = self.runner.block_size
        dev = self.runner.device
        as_rows = all(len(tokens) <= DECODE_ROWS for _, _, tokens in entries)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        lens: list[int] = []
        tables: list[list[int]] = []
        last_rows: list[int] = []  # each entry's last token's row
        for seq, start, tokens in entries:
            end = start + len(tokens)
            table = seq.block_table
            ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            for row_start, row_end in [(p, p + 1) for p in range(start, end)] if as_rows else [(start, end)]:
                cu.append(cu[-1] + row_end - row_start)
                lens.append(row_end)
                tables.append(table)
            last_rows.append(cu[-1] - 1)
        meta = self.runner.metadata(slots, tables, cu, lens)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
        hidden = self.runner.forward(ids_t, torch.tensor(positions, dtype=torch.int64, device=dev), meta)
        logits = self.runner.model.compute_logits(hidden[last_rows])
        return greedy_indices(logits[:, : self.vocab_size]).tolist()  # as the sampler's greedy rows
