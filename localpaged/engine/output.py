"""What a request hands back: RequestOutput and its metrics, and the incremental detokenizer behind ``delta``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# Why a request ended: its stop token or string, a token limit (max_tokens or the context), an abort, an error.
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


@dataclass
class RequestMetrics:
    ttft_s: float | None  # arrival to first generated token
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    generated_tokens: int
    decode_tokens_per_s: float | None  # after the first token
    disk_tokens: int = 0  # of the cached tokens, those read from the disk tier


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the likeliest alternatives, from the model's own distribution
    (log-softmax of its logits, before penalties, bias, temperature, top-k/p and any grammar mask, as vLLM's
    default)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the ``logprobs`` likeliest (token id, log-probability), likeliest first


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated so far, stop string excluded
    delta: str  # text new since this request's previous output
    finished: bool
    finish_reason: FinishReason | None  # None until it finishes; "error": ``error`` says why
    metrics: RequestMetrics
    error: str | None = None  # why this request alone failed; every other request goes on
    index: int = 0  # which of the request's ``n`` samples this is
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the request asked for them


class IncrementalDetokenizer:
    """Text of the generated tokens, grown a token at a time.

    Decodes only a short window of recent tokens (as vLLM does) and holds text back while it ends
    in an incomplete multi-byte character (U+FFFD) or in the beginning of a stop string, so a
    ``delta`` never shows a broken character or half a stop string.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])  # context so that the first token decodes with its leading space
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""
        self.emitted = 0  # characters of text already handed out
        self.stopped = False

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        for s in self.stop:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True

    def take_delta(self, final: bool) -> str:
        """The text not yet handed out, minus a possible stop-string beginning unless the request is over."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _held_back(self) -> int:
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass
class KVMap:
    """The block pool at a glance, for the TUI's KV map."""

    states: list[int]  # per block: 0 free, 1 used by one request, 2 shared by several, 3 cached but free
    highlight: list[int]  # blocks holding the asked-for tokens' cached prefix
    block_size: int
    block_bytes: int
    bytes_saved: int  # memory that sharing saves right now
