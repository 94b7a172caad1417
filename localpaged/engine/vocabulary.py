"""A front end's own copy of the engine's tokenizer: text to token ids and back, each token's bytes, and the
chat template, behind one lock.

What the server's /tokenize, /detokenize and logprob texts and the tool format's choice need, given by
``EngineClient.vocabulary()`` rather than read off the engine's attributes. A copy: the core thread
detokenizes with its own, and a fast tokenizer used from two threads at once fails ("Already borrowed").
"""

from __future__ import annotations

import copy
import threading
from typing import Any


class Vocabulary:
    """One tokenizer's ids, texts and chat template; safe to use from any thread."""

    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: a Hugging Face tokenizer, copied here (the caller may go on using its own)."""
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()
        self.size: int = len(self._tokenizer)  # ids run from 0 to size - 1
        self.chat_template: str | dict | None = getattr(self._tokenizer, "chat_template", None)
        decoder = getattr(getattr(self._tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_of = (
            {ch: b for b, ch in _byte_level_alphabet().items()} if type(decoder).__name__ == "ByteLevel" else {}
        )
        self._bytes: dict[int, bytes] = {}

    def encode(self, text: str, *, literal: bool = False) -> list[int]:
        """``text`` as the engine encodes a string prompt (no special tokens added); ``literal``: control-token
        strings in it (``<|im_end|>``) are ordinary text, as in a message."""
        if not text:
            return []
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=literal))

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ids below ``size``."""
        with self._lock:
            return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (part of a character, for some): looked up once, then kept."""
        found = self._bytes.get(token_id)
        if found is None:
            with self._lock:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
                if self._byte_of and piece is not None and all(ch in self._byte_of for ch in piece):
                    found = bytes(self._byte_of[ch] for ch in piece)
                else:  # a special token, or a tokenizer whose pieces are not byte-level (sentencepiece's "▁")
                    found = self._tokenizer.decode([token_id]).encode()
            self._bytes[token_id] = found
        return found

    def token_text(self, token_id: int) -> str:
        """A token's bytes as text (U+FFFD for a part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE spelling of each byte: printable ones as themselves, the rest shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelled)
    spelled.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return spelled
