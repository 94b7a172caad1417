"""The n-gram draft proposer (vLLM's ``ngram``, llama.cpp's prompt lookup) for speculative decoding.

It looks up the sequence's last ``n`` tokens earlier in its own prompt + output, trying the longest
``n`` first, and proposes the (up to) ``k`` tokens that followed that earlier occurrence. The most
recent earlier occurrence wins: in a code edit or a regenerated reply the nearest copy is the one
being repeated. Pure Python and no torch, so the scheduler can call it each step.
"""

from __future__ import annotations

from collections.abc import Sequence

from localpaged.errors import ConfigError


class NgramProposer:
    """Proposes up to ``k`` draft tokens by matching the last ``max_n`` .. ``min_n`` tokens."""

    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 3) -> None:
        if k < 1:
            raise ConfigError(f"speculative k must be at least 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"speculative n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """The draft tokens after the last n-gram's most recent earlier occurrence; [] when none matches."""
        k = self.k if k is None else k
        total = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            tail = list(token_ids[total - n :])
            # Search right to left, starting so that the match ends before the tail itself does.
            for start in range(total - n - 1, -1, -1):
                if list(token_ids[start : start + n]) == tail:
                    follow = token_ids[start + n : start + n + k]
                    return list(follow)
        return []
