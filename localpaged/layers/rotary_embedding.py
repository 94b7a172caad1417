"""Rotary position embedding: the frequencies a config asks for, the cos/sin tables, and the rotation.

The tables are float32 and indexed per token, so one forward gathers each token's row once and every
layer rotates with it; the native CPU path rotates inside ``Attention`` (fused with the K/V write),
``apply_rope`` is the torch rotation every other path uses.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from localpaged.errors import UnsupportedModelError


def rope_params(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def rotary_dim_of(config, head_dim: int) -> int:
    """Dimensions of each head that RoPE rotates: all but where ``partial_rotary_factor`` says (Phi-4-mini: 0.75)."""
    factor = rope_params(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)


def rope_frequencies(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotated dimensions, and the factor that scales cos and sin (1 but for LongRoPE).

    Only the first ``rotary_dim_of`` dimensions of each head rotate. Scaling: linear, llama3, Phi-3's LongRoPE, and a GGUF's ``rope_freqs`` tensor (llama.cpp's
    per-dimension divisors, what its converter writes for Llama 3.x; ``rope_freq_factors`` in the config).
    LongRoPE uses its long factors when the engine's context (``max_positions``) exceeds the original
    training context and its short ones otherwise, at every position alike, as llama.cpp chooses by its
    context size. transformers chooses per forward pass by the sequence's length; the two agree on any
    sequence kept within the original context or run with long factors from its first token. One table
    per position is what prefix caching needs: a block's K/V may depend on nothing but its tokens.
    """
    params = rope_params(config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    dim = rotary_dim_of(config, head_dim)
    if kind == "longrope":  # in float32 as transformers computes it
        original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
        factors = torch.tensor(params["long_factor" if max_positions > original else "short_factor"])
        factor = params.get("factor") or config.max_position_embeddings / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return 1.0 / (factors.float() * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freq_factors = getattr(config, "rope_freq_factors", None)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / params["factor"]).float(), 1.0
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported; supported: default, linear, llama3, longrope")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, head_dim]`` by per-token ``cos``/``sin`` ``[N, 1, rotary_dim/2]`` (halves layout);
    dimensions past ``rotary_dim`` (partial rotary) pass through."""
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of every position up to ``max_positions``; called with positions, gives each token's rows."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        rotary_half = rotary_dim_of(config, head_dim) // 2
        self.register_buffer("cos", torch.empty(max_positions, rotary_half), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, rotary_half), persistent=False)
        self.init_tables()

    def init_tables(self) -> None:
        """Fill the float32 tables; called again once a model built on the meta device has memory."""
        if self.cos.is_meta:
            return
        inv_freq, scale = rope_frequencies(self.config, self.head_dim, self.cos.shape[0])
        positions = torch.arange(self.cos.shape[0], dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq).to(self.cos.device)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        if scale != 1.0:  # LongRoPE's attention factor, on cos and sin as transformers applies it
            self.cos, self.sin = self.cos * scale, self.sin * scale

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[N, 1, rotary_dim/2]`` of each token's position, shaped to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
