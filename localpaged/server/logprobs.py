"""Log-probabilities in OpenAI's shapes, from the engine's ``TokenLogprob`` list.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``;
text completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
A token's text is its own bytes, decoded (a token that holds part of a character shows U+FFFD, its
``bytes`` the real ones), so ``bytes`` of consecutive tokens join into the reply's UTF-8.
"""

from __future__ import annotations

from localpaged.engine.output import RequestOutput, TokenLogprob
from localpaged.engine.vocabulary import Vocabulary


def new_logprobs(out: RequestOutput, sent: int) -> list[TokenLogprob]:
    """The entries of ``out.logprobs`` not handed out yet, ``sent`` having been. An engine may send the whole
    list each time (as long as ``token_ids``) or only the new ones; both read the same here."""
    entries = out.logprobs or []
    return entries[sent:] if len(entries) == len(out.token_ids) else entries


def chat_logprobs(entries: list[TokenLogprob], texts: Vocabulary) -> dict:
    """A chat choice's ``logprobs``: one item per generated token, with its ``top_logprobs``."""

    def item(token_id: int, logprob: float) -> dict:
        raw = texts.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}

    content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], texts: Vocabulary, offset: int) -> dict:
    """A text completion's ``logprobs``; ``offset``: characters of the reply before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        token = texts.token_text(e.token_id)
        tokens.append(token)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [{texts.token_text(t): _finite(lp) for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token of probability 0 (masked by a grammar) reads as OpenAI's floor, -9999."""
    return max(-9999.0, logprob)
