"""Projections: float weights (``Linear``) or a GGUF's quantised blocks (``BlockLinear``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from localpaged.kernels import cpu

# A prompt of at least this many tokens takes the tiles: each call lays out every weight for them, which costs more
# than they save under about 24 rows. The prompt's own length, not what is left after the prefix cache, so that its
# rows take one path whatever the cache held.
TILE_PROMPT_MIN = 24


@dataclass(frozen=True)
class PromptRows:
    """The rows of a step's flat batch that are prompt tokens (``index``) and the others (``rest``; None where every
    row is a prompt's), int64. ``BlockLinear`` runs a prompt's rows on AMX tiles where those run
    (``cpu.qgemm(..., prompt=True)``) in every step, so a prompt's K/V and first token do not depend on how it was
    chunked or batched, nor on what the prefix cache held; decoded, draft and recomputed tokens, and the rows of a
    prompt of fewer than ``TILE_PROMPT_MIN`` tokens, run as a decode step runs them."""

    index: torch.Tensor
    rest: torch.Tensor | None

    @staticmethod
    def of(prompt: list[int], rows: int, device: torch.device) -> PromptRows | None:
        """The split of ``rows`` rows whose prompt rows are ``prompt`` (ascending); None where there are none."""
        if not prompt:
            return None
        index = torch.tensor(prompt, dtype=torch.int64, device=device)
        if len(prompt) == rows:
            return PromptRows(index, None)
        rest = torch.ones(rows, dtype=torch.bool, device=device)
        rest[index] = False
        return PromptRows(index, rest.nonzero().squeeze(1))


class Linear(nn.Linear):
    """nn.Linear that, on the CPU and for the few rows of a decode step, computes ``(W @ x.T).T``.

    MKL's GEMM is faster in that orientation for 1-128 rows, and decode steps are such rows. A very
    tall weight (the LM head: 49152 rows) goes in slices of ``ROW_SLICE`` rows, which keeps each
    slice's working set in cache: faster again than the whole weight transposed.
    """

    ROW_SLICE = 1024

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """``prompt_rows`` is BlockLinear's: float weights compute every row alike."""
        if x.device.type != "cpu" or x.shape[0] > 128:
            return F.linear(x, self.weight, self.bias)
        xt = x.t()
        if self.weight.shape[0] > 8 * self.ROW_SLICE:
            out = torch.cat([torch.mm(w, xt) for w in self.weight.split(self.ROW_SLICE)]).t()
        else:
            out = torch.mm(self.weight, xt).t()
        return out + self.bias if self.bias is not None else out


class BlockLinear(nn.Module):
    """A projection on the native kernel, its weight kept in blocks packed into 16-row tiles (kernels/cpu.py).

    ``packed``: ``cpu.pack_blocks`` of an int8 ``[out, in]`` with a scale and a min per run of 32 or 16 weights, each
    an fp16 unit times an int8 as a GGUF stores them: 0.6-1.1 bytes a weight instead of 4, and decode reads every
    weight once a step (``engine/setup.py``'s ``use_block_weights`` says when a model keeps its blocks, and what it
    bought). Its ``activations`` (kernels/cpu.py's ACTIVATIONS) say how input rows meet the weights: as they are, or
    rounded to int16 or int8 per run first (``resolve_activations`` there says which a model gets, and why).
    """

    def __init__(self, packed: cpu.PackedBlocks, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.rows, packed.cols
        self.packed = packed
        for name in cpu.PACKED_TENSORS:  # registered too, so the model's memory counts them
            self.register_buffer(name, getattr(packed, name))
        self.bias = bias

    def move_to(self, packed: cpu.PackedBlocks) -> None:
        """The same weight in other storage (``models.huge_pages``): every field and tensor shape as they were."""
        if _layout(packed) != _layout(self.packed):
            raise ValueError("move_to takes this projection's packed weight in other memory, not another weight")
        self.packed = packed
        for name in cpu.PACKED_TENSORS:
            setattr(self, name, getattr(packed, name))

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        if prompt_rows is None or self.packed.activations != "int16":  # only int16 weights have a prompt path
            out = cpu.qgemm(x, self.packed)
        elif prompt_rows.rest is None:
            out = cpu.qgemm(x, self.packed, prompt=True)
        else:
            out = x.new_empty(x.shape[0], self.out_features)
            out[prompt_rows.index] = cpu.qgemm(x[prompt_rows.index], self.packed, prompt=True)
            out[prompt_rows.rest] = cpu.qgemm(x[prompt_rows.rest], self.packed)
        return out + self.bias if self.bias is not None else out


def _layout(packed: cpu.PackedBlocks) -> tuple:
    """What a packed weight is, apart from where its tensors lie: its fields, its tensors' shapes and types."""
    fields = tuple(getattr(packed, f.name) for f in dataclasses.fields(packed) if f.name not in cpu.PACKED_TENSORS)
    tensors = (getattr(packed, n) for n in cpu.PACKED_TENSORS)
    return fields + tuple(None if t is None else (t.shape, t.dtype) for t in tensors)
