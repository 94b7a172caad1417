"""SiluAndMul: the gated activation of a Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localpaged.kernels import cpu


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``gate_up`` ``[N, 2I]`` (gate first, as the fused gate_up projection writes it).

    Float32 on the CPU with I a multiple of 8 goes to the native kernel: one pass over the rows where
    torch makes the silu tensor and then the product; everything else goes to torch.
    """

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if cpu.runs(gate_up.device, gate_up.dtype) and gate_up.shape[-1] % 16 == 0:
            return cpu.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
