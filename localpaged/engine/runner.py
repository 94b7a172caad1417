"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, and samples.

Owns the KV cache tensors: ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``,
each layer's attention bound to its slice. Only sequences whose last scheduled token is their
last token get logits; a prefill chunk in the middle of a prompt produces none.

A sequence with draft tokens (engine.speculative) runs its last token and each draft as a decode row of
its own, over the same block table, row j attending the sequence's first ``num_computed_tokens + j + 1``
tokens: every path computes such a row as it computes any decode (the native decode step, CUDA graphs,
the decode kernels), so a kept draft's token is the one a step without drafts would pick. Each row gets
logits; the tokens are kept up to the first draft the sampler disagrees with (``accept``). A draft model's
drafts (engine.draft) are computed here, first thing in ``run``, once the scheduler has allocated their slots.
"""

from __future__ import annotations

import math
import mmap
from itertools import pairwise
from typing import TYPE_CHECKING

import torch

from localpaged.engine import cascade as cascade_groups
from localpaged.engine.cuda_graphs import DecodeGraphs
from localpaged.engine.sampler import SampledToken, sample
from localpaged.engine.scheduler import ScheduledBatch
from localpaged.engine.structured import apply_grammar_bitmask
from localpaged.kernels.torch_attention import CascadePlan
from localpaged.layers.attention import Attention, AttentionMetadata
from localpaged.layers.linear import TILE_PROMPT_MIN, PromptRows
from localpaged.models.huge_pages import HugePageMove
from localpaged.models.llama_cpu_decode import NativeDecode

if TYPE_CHECKING:
    from localpaged.engine.draft import DraftModel


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. Zeroed, not empty: the torch path reads padding from block 0, and a
    NaN there would leak through the masked softmax (0 * NaN). On the CPU the memory is an anonymous
    mmap, whose pages the OS zeroes on first touch: a large pool then costs nothing at start-up
    instead of a memset of all of it. Not numpy's calloc: numpy asks for transparent huge pages on
    large arrays, and then the first KV block of each layer took a whole huge page of memory; 4 KiB
    pages grow with the blocks used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elem = torch.tensor([], dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(1, math.prod(shape) * elem), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model,
        attention,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        graph_batch_sizes: int = 0,
        max_model_len: int = 0,
        cascade: bool = False,
        huge_pages: bool = False,
    ) -> None:
        """``graph_batch_sizes`` > 0 captures CUDA graphs of decode steps up to that many sequences. ``cascade``:
        find the step's groups of sequences sharing leading blocks (``engine.cascade``) for the attention
        kernels, where the path takes them; a plain attribute, so a benchmark can time both in one process.
        ``huge_pages``: copy the packed weights onto 2 MiB pages and swap them in once copied (setup decides)."""
        self.model = model
        self.attention = attention
        self.cascade = cascade and getattr(attention, "takes_cascade", False)
        self.cascade_tiers = cascade_groups.TIERS  # the groups that pay; an attribute, so a test can group small ones
        self.block_size = block_size
        self.device = device
        cfg = model.config
        shape = (2, cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, model.head_dim)
        self.kv_cache = zeroed(shape, kv_dtype, device)
        if device.type == "cpu":  # the pool as bytes, for block_buffers
            self._pool_bytes = memoryview(self.kv_cache.view(-1).view(torch.uint8).numpy())
        self._staging: torch.Tensor | None = None  # elsewhere, the host side of blocks read from disk
        for i, attn in enumerate(m for m in model.modules() if isinstance(m, Attention)):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        self.graphs = None
        if graph_batch_sizes:
            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(model, attention, graph_batch_sizes, max_blocks, block_size, device)
        self.native_decode = NativeDecode.build(model, attention)  # None where the model's modules must run
        # packed weights on their way onto huge pages, swapped in between steps once copied (models.huge_pages)
        self.huge_pages = HugePageMove.start(model) if huge_pages else None
        self.drafter: DraftModel | None = None  # a draft model, which fills the drafts it owes (engine.draft)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's K and V of every layer, as the disk tier stores it: [2, layers, block_size, kv heads, head dim]."""
        two, layers, _, *rest = self.kv_cache.shape
        return (two, layers, *rest)

    def _by_block(self) -> torch.Tensor:
        """The KV cache viewed with the block index first; indexing it copies whole blocks."""
        return self.kv_cache.permute(2, 0, 1, 3, 4, 5)

    def gather_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """A private copy of each block's bytes (one copy for all of them), for the disk tier's writer."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        blocks = self._by_block().index_select(0, index).cpu().view(torch.uint8).numpy()
        return [memoryview(block).cast("B") for block in blocks]

    def block_buffers(self, block_ids: list[int]) -> list[list[memoryview]]:
        """Writable bytes of each block, in ``gather_blocks``' layout, for the disk tier to read files into.

        On the CPU these are the pool's own memory, one slice per layer's K and V (a block is
        2 x layers runs of ``block_size * kv heads * head dim`` values there), so a block file is read
        straight into place with one ``preadv``, on the disk tier's reader threads (first-touch page
        faults of the pool and the checksums run in parallel), with no bytes object, staging tensor or
        indexed copy between (benchmarks/kv_disk.py times the reads). Elsewhere they are one row each
        of a pinned host staging tensor that ``commit_blocks`` copies to the device.
        """
        if self.device.type == "cpu":
            two, layers, num_blocks, *_ = self.kv_cache.shape
            run = self.kv_cache[0, 0, 0].numel() * self.kv_cache.element_size()
            starts = [(kv * layers + layer) * num_blocks * run for kv in range(two) for layer in range(layers)]
            return [[self._pool_bytes[s + b * run : s + (b + 1) * run] for s in starts] for b in block_ids]
        self._staging = torch.empty((len(block_ids), *self.block_shape), dtype=self.kv_cache.dtype, pin_memory=True)
        rows = self._staging.view(torch.uint8).numpy().reshape(len(block_ids), -1)
        return [[memoryview(row)] for row in rows]

    def commit_blocks(self, block_ids: list[int]) -> None:
        """Make what the disk tier read into the first ``len(block_ids)`` of the last ``block_buffers`` the blocks' contents."""
        if self.device.type == "cpu" or not block_ids:
            return
        assert self._staging is not None, "block_buffers() comes first"
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self._by_block()[index] = self._staging[: len(block_ids)].to(self.device)

    def copy_block(self, src: int, dsts: list[int]) -> None:
        """Copy block ``src``'s K and V of every layer into each block of ``dsts``, in one indexed copy."""
        index = torch.tensor(dsts, dtype=torch.int64, device=self.device)
        self.kv_cache[:, :, index] = self.kv_cache[:, :, src : src + 1]

    @staticmethod
    def bytes_per_block(config, head_dim: int, block_size: int, kv_dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim * elem

    def metadata(
        self, slots: list[int], tables: list[list[int]], cu: list[int], context_lens: list[int]
    ) -> AttentionMetadata:
        """The attention metadata of a forward's entries over the pool: the KV slots its tokens write, each entry's
        block table (padded to the longest), query row offsets and context length."""
        width = max(len(t) for t in tables)
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            max_q_len=max(b - a for a, b in pairwise(cu)),
            block_size=self.block_size,
        )

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Input ids, positions, attention metadata, the sequences that reach their end this step
        (indices into the batch, a sequence once per row with logits: its last token's, and each draft's),
        and the rows whose logits are needed."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []  # the metadata's entries: a sequence, or a row of one with drafts
        limits: list[int] = []  # each entry's whole blocks computed before this step, for the cascade groups
        logit_rows: list[int] = []
        to_sample: list[int] = []
        prompt_rows: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + n
            if seq.num_prompt_tokens >= TILE_PROMPT_MIN:
                prompt = max(min(end, seq.num_prompt_tokens) - start, 0)
                prompt_rows.extend(range(len(positions), len(positions) + prompt))
            drafts = seq.spec_token_ids
            input_ids.extend(seq.token_ids[start : end - len(drafts)] + drafts)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            computed = start // bs
            if drafts:  # a decode row per position; only the first may join a cascade group (see the docstring)
                for p in range(start, end):
                    cu.append(cu[-1] + 1)
                    context_lens.append(p + 1)
                    tables.append(table)
                    limits.append(computed if p == start else 0)
                to_sample.extend([i] * n)
                logit_rows.extend(range(cu[-1] - n, cu[-1]))
                continue
            cu.append(cu[-1] + n)
            context_lens.append(end)
            tables.append(table)
            limits.append(computed)
            if end == seq.num_tokens:
                to_sample.append(i)
                logit_rows.append(cu[-1] - 1)
        meta = self.metadata(slots, tables, cu, context_lens)
        dev = self.device
        if dev.type == "cpu":  # only the CPU's block projections read it
            meta.prompt_rows = PromptRows.of(prompt_rows, len(positions), dev)
        if self.cascade and len(tables) > 1:
            meta.cascade = self.cascade_plan(tables, limits)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, to_sample, logit_rows

    def cascade_plan(self, tables: list[list[int]], limits: list[int]) -> CascadePlan | None:
        """The step's shared-prefix groups as the kernels take them, or None where there is none. A member shares
        only whole blocks of what it computed before this step (``limits``), so no query of the step is masked
        from them."""
        groups = cascade_groups.find_groups(tables, limits, self.cascade_tiers)
        if not groups:
            return None
        starts = [0]
        for group in groups:
            starts.append(starts[-1] + len(group.members))
        return CascadePlan(
            group_starts=torch.tensor(starts, dtype=torch.int32, device=self.device),
            members=torch.tensor([i for g in groups for i in g.members], dtype=torch.int32, device=self.device),
            shared_lens=torch.tensor(
                [g.shared_blocks * self.block_size for g in groups], dtype=torch.int32, device=self.device
            ),
        )

    def settle(self) -> None:
        """Waits for the packed weights' copy onto huge pages (this runner's, and its draft model's) and swaps it in
        now, where a pass would have swapped it in once it was done."""
        for runner in (self, self.drafter.runner if self.drafter is not None else None):
            if runner is not None and runner.huge_pages is not None:
                runner.huge_pages.wait()
                runner._swap_in_huge_pages()

    def _swap_in_huge_pages(self) -> None:
        self.huge_pages.swap_in()
        self.huge_pages = None
        if self.native_decode is not None:
            self.native_decode.rebind()  # its pointers, to the copies

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's final hidden states over the rows of ``meta``, on the fastest path that takes them."""
        if self.huge_pages is not None and self.huge_pages.ready():  # every pass comes here, a draft model's too
            self._swap_in_huge_pages()
        if self.graphs is not None and meta.cascade is None and self.graphs.can_run(meta, len(meta.context_lens)):
            return self.graphs.run(ids, pos, meta)
        if self.native_decode is not None and meta.max_q_len == 1 and meta.prompt_rows is None:
            return self.native_decode.run(ids, pos, meta)
        self.attention.prepare(meta)
        return self.model(ids, pos, meta)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[list[SampledToken] | Exception | None]:
        """One forward over the batch; for each sequence that reached its end its new tokens (and their logprobs):
        one, or with drafts the kept drafts and the token after them; else None.

        A sequence whose own sampling failed gets the exception instead of tokens (see ``sample``);
        a failure of the batch as a whole (the forward pass) raises.
        """
        if self.drafter is not None:
            self.drafter.propose(batch)
        ids, pos, meta, to_sample, logit_rows = self.prepare(batch)
        hidden = self.forward(ids, pos, meta)
        if not logit_rows:
            return [None] * len(batch.seqs)
        # every row's logits in a decode step: the rows as they are, not an indexed copy of them
        logits = self.model.compute_logits(hidden if len(logit_rows) == len(hidden) else hidden[logit_rows])
        rows = [batch.seqs[i] for i in to_sample]
        # The grammar masks constrained rows only (the others sample as they would alone), after the raw logprobs.
        tokens: list[list[SampledToken | Exception] | None] = [None] * len(batch.seqs)
        for i, token in zip(to_sample, sample(logits, rows, mask=lambda raw: apply_grammar_bitmask(raw, rows))):
            tokens[i] = [token] if tokens[i] is None else tokens[i] + [token]
        return [None if t is None else accept(seq.spec_token_ids, t) for seq, t in zip(batch.seqs, tokens)]


def accept(drafts: list[int], tokens: list[SampledToken | Exception]) -> list[SampledToken] | Exception:
    """A sequence's new tokens from the tokens picked at its rows (its last token's, then each draft's): each row's
    token while the draft it checks matches it, up to the first mismatch, whose token (the target's own choice
    there) comes last; a failed row that is reached fails the sequence."""
    kept: list[SampledToken] = []
    for j, token in enumerate(tokens):
        if isinstance(token, Exception):
            return token
        kept.append(token)
        if j == len(drafts) or token.token_id != drafts[j]:
            break
    return kept
