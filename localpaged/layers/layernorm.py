"""RMSNorm fused with the residual add, as in vLLM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localpaged.kernels import cpu


class RMSNorm(nn.Module):
    """RMS norm of ``x + residual``: returns the normed rows and the sum (the new residual).

    Float32 rows on the CPU whose width is a multiple of 8 (the kernel reads runs of 8 floats) go to
    the native kernel: add and norm in one pass, where torch ran a chain of small ops (a visible part
    of a 16-session decode step when the native kernels came in). Float32 elsewhere goes to
    ``F.rms_norm``, one fused kernel; other dtypes norm in float32 as transformers does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu.runs(x.device, x.dtype) and x.shape[-1] % 8 == 0:
            return cpu.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:  # one fused kernel; same result as the general path below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), x
