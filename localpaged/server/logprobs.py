"""Log-probabilities in OpenAI's shapes, from the engine's ``TokenLogprob`` list.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``;
text completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
A token's text is its own bytes, decoded (a token that holds part of a character shows U+FFFD, its
``bytes`` the real ones), so ``bytes`` of consecutive tokens join into the reply's UTF-8.
"""

from __future__ import annotations

from typing import Any

from localpaged.engine.output import RequestOutput, TokenLogprob


class TokenTexts:
    """Each token id's bytes and text under one tokenizer, looked up once and kept."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)).__name__ == (
            "ByteLevel"
        )
        self._bytes: dict[int, bytes] = {}
        self._byte_of: dict[str, int] = {}
        if self._byte_level:
            self._byte_of = {ch: b for b, ch in _byte_level_alphabet().items()}

    def token_bytes(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self._byte_level and piece is not None and all(ch in self._byte_of for ch in piece):
                found = bytes(self._byte_of[ch] for ch in piece)
            else:  # a special token, or a tokenizer whose pieces are not byte-level (sentencepiece's "▁")
                found = self.tokenizer.decode([token_id]).encode()
            self._bytes[token_id] = found
        return found

    def text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE spelling of each byte: printable ones as themselves, the rest shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelled)
    spelled.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return spelled


def new_logprobs(out: RequestOutput, sent: int) -> list[TokenLogprob]:
    """The entries of ``out.logprobs`` not handed out yet, ``sent`` having been. An engine may send the whole
    list each time (as long as ``token_ids``) or only the new ones; both read the same here."""
    entries = out.logprobs or []
    return entries[sent:] if len(entries) == len(out.token_ids) else entries


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """A chat choice's ``logprobs``: one item per generated token, with its ``top_logprobs``."""

    def item(token_id: int, logprob: float) -> dict:
        raw = texts.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}

    content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offset: int) -> dict:
    """A text completion's ``logprobs``; ``offset``: characters of the reply before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        token = texts.text(e.token_id)
        tokens.append(token)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [{texts.text(t): _finite(lp) for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token of probability 0 (masked by a grammar) reads as OpenAI's floor, -9999."""
    return max(-9999.0, logprob)
