"""Draft proposers for speculative decoding: n-gram lookup in a sequence's own tokens and in the engine's history.

``NgramIndex`` maps every n-gram (``min_n`` .. ``max_n`` tokens) of a growing token list to the end of its
most recent occurrence, so a lookup costs a few dict reads however long the list is; it grows by the tokens
appended since the last call (the tokens of a sequence only ever grow: rejected drafts never enter it).

``NgramProposer`` (vLLM's ``ngram``, llama.cpp's prompt lookup) looks up the sequence's last ``n`` tokens,
longest ``n`` first, earlier in its own prompt + output, and proposes the (up to) ``k`` tokens that followed
that occurrence: the most recent one, since in a code edit or a quoted message the nearest copy is the one
being repeated. ``History`` holds what the engine generated for earlier requests, one index over all of
it, so a regenerated reply or an edited re-ask finds the earlier reply (vLLM's suffix decoding). Pure
Python and no torch: the scheduler calls them each step.
"""

from __future__ import annotations

from collections.abc import Sequence

from localpaged.errors import ConfigError


class NgramIndex:
    """The end position of each n-gram's most recent occurrence in a token list, grown incrementally.

    Keys are the n-grams' hashes (ints keep the dict small); a lookup checks the tokens themselves, so a hash
    collision costs a missed proposal, never a wrong one.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[int, int] = {}
        self.size = 0  # tokens indexed: every n-gram ending before this position is in ``ends``

    def grow(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end before position ``upto``."""
        ends = self.ends
        for end in range(self.size, upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                ends[hash(tuple(tokens[end - n + 1 : end + 1]))] = end
        self.size = max(self.size, upto)

    def find(self, tokens: Sequence[int], gram: Sequence[int]) -> int | None:
        """The end position in ``tokens`` (the list this index was grown over) of ``gram``'s most recent indexed
        occurrence, or None."""
        end = self.ends.get(hash(tuple(gram)))
        if end is None or list(tokens[end - len(gram) + 1 : end + 1]) != list(gram):
            return None
        return end


class NgramProposer:
    """Proposes up to ``k`` draft tokens by matching the last ``max_n`` .. ``min_n`` tokens of a sequence."""

    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 3) -> None:
        if k < 1:
            raise ConfigError(f"speculative k must be at least 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"speculative n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def index(self) -> NgramIndex:
        """A new index for one sequence (kept by the caller and handed back to ``propose``)."""
        return NgramIndex(self.min_n, self.max_n)

    def propose(
        self, token_ids: Sequence[int], k: int | None = None, index: NgramIndex | None = None
    ) -> tuple[list[int], int]:
        """The draft tokens after the last n-gram's most recent earlier occurrence, and that n; ([], 0) when none
        matches. ``index`` (from ``index()``) is grown over ``token_ids`` and kept for the next call."""
        k = self.k if k is None else k
        total = len(token_ids)
        if k <= 0 or total < 2:
            return [], 0
        index = index or self.index()
        index.grow(token_ids, total - 1)  # every n-gram that ends before the tail's own last token
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            end = index.find(token_ids, token_ids[total - n :])
            if end is not None:
                return list(token_ids[end + 1 : end + 1 + k]), n
        return [], 0


class History:
    """What the engine generated for earlier requests (each reply after the last prompt tokens that led to it), as
    one token list with an n-gram index over it, at most ``max_tokens`` long: when full, the older half is
    dropped and the rest indexed again."""

    SEPARATOR = -1  # between requests: no n-gram spans two of them

    def __init__(self, min_n: int, max_n: int, max_tokens: int = 1 << 16) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.tokens: list[int] = []
        self.index = NgramIndex(min_n, max_n)

    def add(self, token_ids: Sequence[int]) -> None:
        """Remember one request's tokens (the caller passes its reply and the prompt tokens just before it)."""
        token_ids = token_ids[-(self.max_tokens // 2) :]
        if len(self.tokens) + len(token_ids) + 1 > self.max_tokens:
            self.tokens, self.index = self.tokens[-(self.max_tokens // 2) :], NgramIndex(self.min_n, self.max_n)
        self.tokens.extend(token_ids)
        self.tokens.append(self.SEPARATOR)
        self.index.grow(self.tokens, len(self.tokens))

    def propose(self, token_ids: Sequence[int], k: int, at_least: int) -> tuple[list[int], int]:
        """What followed the most recent earlier occurrence of ``token_ids``' last n tokens, for the longest
        n >= ``at_least`` that occurs, and that n; ([], 0) when none does."""
        total = len(token_ids)
        for n in range(min(self.max_n, total), max(at_least, self.min_n) - 1, -1):
            end = self.index.find(self.tokens, token_ids[total - n :])
            if end is not None:
                follow = self.tokens[end + 1 : end + 1 + k]
                if self.SEPARATOR in follow:
                    follow = follow[: follow.index(self.SEPARATOR)]
                if follow:
                    return follow, n
        return [], 0
