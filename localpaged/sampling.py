"""SamplingParams, and the sampler that turns a step's logits into one token per finishing sequence."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from localpaged.errors import ConfigError

MAX_TOKENS_LIMIT = 1 << 20  # beyond any context we can hold: a value above it is a mistake


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None  # per-request: the same seed gives the same sample, whatever else runs
    stop: list[str] = field(default_factory=list)  # strings that end the reply (not included in it)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to EOS and end-of-turn
    ignore_eos: bool = False  # keep going past EOS/end-of-turn (benchmarks)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_tokens!r}: ask for at least 1 token")
        if self.max_tokens > MAX_TOKENS_LIMIT:
            raise ConfigError(
                f"max_tokens={self.max_tokens}: more than any context holds; use at most {MAX_TOKENS_LIMIT}"
            )
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature}: must be 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]; 1 turns it off")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: must be 0 (off) or more")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream; None when greedy."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[S, vocab]``; greedy rows in one argmax, others row by row."""
    out = logits.argmax(dim=-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            out[i] = _sample_row(logits[i].float(), p, g)
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
