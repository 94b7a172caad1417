"""CUDA graphs of the decode step, one per batch size on a ladder (as nano-vllm does).

A decode step of a small model is hundreds of tiny kernel launches; replaying a captured graph
launches them all at once. Graphs need fixed addresses and shapes, so a step is copied into
static buffers padded up to the next captured batch size: padded rows write nowhere (slot -1),
attend to one token and are dropped. Block tables are captured at full width
(``max_model_len / block_size``) so any sequence fits, and the Triton decode kernel picks its
number of splits from shapes alone. With ``capture=False`` the same buffers run eagerly, which is
how the padding is tested on machines without a GPU.
"""

from __future__ import annotations

import torch

from localpaged.layers.attention import AttentionMetadata


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model,
        attention,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.sizes = batch_ladder(max_batch)
        self.capture = capture
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens[: bs + 1],
            context_lens=self.context_lens[:bs],
            max_q_len=1,
            block_size=self.block_size,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        meta = self._meta(bs)
        self.attention.prepare(meta)
        return self.model(self.input_ids[:bs], self.positions[:bs], meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(bs)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata, num_seqs: int) -> bool:
        return (
            meta.max_q_len == 1
            and num_seqs <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only step, through the graph of the next batch size up."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = meta.context_lens
        self.context_lens[n:bs] = 1
        self.block_tables[:bs].zero_()
        self.block_tables[:n, :width] = meta.block_tables
        if not self.capture:
            return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
