"""Projections: float weights (``Linear``) or a GGUF's quantised blocks (``BlockLinear``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localpaged.kernels import cpu


class Linear(nn.Linear):
    """nn.Linear that, on the CPU and for the few rows of a decode step, computes ``(W @ x.T).T``.

    MKL's GEMM is faster in that orientation for 1-128 rows, and decode steps are such rows. A very
    tall weight (the LM head: 49152 rows) goes in slices of ``ROW_SLICE`` rows, which keeps each
    slice's working set in cache: faster again than the whole weight transposed.
    """

    ROW_SLICE = 1024

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    ``q`` ``[out, in]`` int8 with a scale and a min per run of 32 or 16 weights, each an fp16 unit times an int8 as
    a GGUF stores them (``cpu.pack_blocks`` takes the same five tensors): 0.6-1.1 bytes a weight instead of 4, and
    decode reads every weight once a step (``engine/setup.py``'s ``use_block_weights`` says when a model keeps its
    blocks, and what it bought). ``activations`` (kernels/cpu.py's ACTIVATIONS) says how input rows meet the weights:
    as they are, or rounded to int16 or int8 per run first (``resolve_activations`` there says which a model gets,
    and why).
    """

    def __init__(
        self,
        q: torch.Tensor,
        unit: torch.Tensor,
        mult: torch.Tensor,
        min_unit: torch.Tensor,
        min_mult: torch.Tensor,
        bias: nn.Parameter | None,
        activations: str = "float32",
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.packed = cpu.pack_blocks(q, unit, mult, min_unit, min_mult, activations)
        for name in ("q", "unit", "mult", "min_unit", "min_mult"):  # registered too, so the model's memory counts them
            self.register_buffer(name, getattr(self.packed, name))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu.qgemm(x, self.packed)
        return out + self.bias if self.bias is not None else out
