"""A fake engine with AsyncLLM's surface, so the real Session and ChatStore run in TUI tests.

Prompts are "tokenised" as UTF-8 bytes of a tiny chat template, so the fake can read back
the last user message and answer it from a script, a word at a time with a small delay.
`die(cause)` plays the core process dying: what AsyncLLM does then, the fake does too.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localpaged.engine.output import KVMap, RequestMetrics, RequestOutput
from localpaged.engine.protocol import LOCAL, EngineInfo, EngineStats, Prompt
from localpaged.errors import EngineDeadError, RequestError

if TYPE_CHECKING:
    from localpaged.engine.protocol import Prompt
    from localpaged.engine.vocabulary import Vocabulary
    from localpaged.sampling import SamplingParams

BLOCK_SIZE = 16
WORD_IDS = 0x110000  # a reply's "tokens" are its words, numbered from here (beyond every character)
FAKE_INFO = EngineInfo("fake-135M", 4096, "cpu", BLOCK_SIZE, LOCAL)
_WORDS: list[str] = []
_WORD_IDS: dict[str, int] = {}


def word_id(word: str) -> int:
    """The token id of one reply word (with its leading space), the same for the same word."""
    if word not in _WORD_IDS:
        _WORD_IDS[word] = WORD_IDS + len(_WORDS)
        _WORDS.append(word)
    return _WORD_IDS[word]


@dataclass
class FakeEngine:
    """Answers `replies[user text]` (or `default(user text)`), `delay` seconds per word.

    With `hold_at` set, every reply pauses after that many words until `release()`: tests
    then see replies mid-stream however slow the machine is. After `die(cause)`, every open
    stream raises EngineDeadError(cause), and so does every later stream, abort, stats, kv_map
    and encode_chat call (`calls_when_dead` counts those); `shutdown` stays safe.
    """

    replies: dict[str, str] = field(default_factory=dict)
    default: Callable[[str], str] = lambda text: f"You said: **{text}**."
    delay: float = 0.01
    hold_at: int | None = None
    blocks_total: int = 96
    info: EngineInfo = FAKE_INFO
    prompts: list[list[int]] = field(default_factory=list)
    params: list[object] = field(default_factory=list)  # the SamplingParams of every stream, in order
    shut_down: bool = False
    cause: str | None = None
    calls_when_dead: int = 0
    disk_tokens: int = 0  # prompt tokens each reply reports as read from the disk KV tier
    drafts: tuple[int, int] | None = None  # speculative decoding's (proposed, accepted) draft tokens, for stats
    prefetched: list[list[dict]] = field(default_factory=list)  # every prefetch's messages, in order
    _aborted: set[str] = field(default_factory=set)
    _running: set[str] = field(default_factory=set)

    def release(self) -> None:
        """Let held replies run to their end."""
        self.hold_at = None

    def die(self, cause: str = "the engine core process died (killed by signal 9 SIGKILL)") -> None:
        """Act as if the core process died: open streams and every later call raise EngineDeadError."""
        self.cause = cause

    def _check_alive(self) -> None:
        if self.cause is not None:
            raise EngineDeadError(self.cause)

    def _call(self) -> None:
        """A call that asks the (maybe dead) core process something."""
        if self.cause is not None:
            self.calls_when_dead += 1
        self._check_alive()

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        self._call()
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"
        return list(text.encode())

    def vocabulary(self) -> Vocabulary | None:
        return None  # the fake's "tokens" are UTF-8 bytes, with no tokenizer behind them

    def prefetch(self, prompt: Prompt) -> int:
        """Record the chat whose blocks the app asked to load; the fake has no disk tier to read."""
        self._call()
        self.prefetched.append(prompt)
        return 0

    def decode(self, ids: list[int]) -> str:
        """Prompt ids back to text: bytes of the template, and word ids (WORD_IDS and up) of a reply being continued."""
        return "".join(chr(i) if i < WORD_IDS else _WORDS[i - WORD_IDS] for i in ids)

    def last_user_text(self, prompt: list[int]) -> str:
        turns = re.findall(r"<\|user\|>(.*?)<\|end\|>", self.decode(prompt), re.DOTALL)
        return turns[-1] if turns else ""

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"req-{len(self.prompts)}"
        self._call()
        if request_id in self._running:
            raise RequestError(f"request id {request_id!r} is already in flight")
        self.prompts.append(list(prompt))
        self.params.append(params)
        self._running.add(request_id)
        text = self.last_user_text(prompt)
        script = self.replies.get(text, None) or self.default(text)
        said = self.decode(prompt).rsplit("<|assistant|>", 1)[-1]  # a continue's prompt ends with the reply so far
        words = re.findall(r"\s*\S+", script.removeprefix(said))
        # A word is a token: the reply ends at max_tokens or a full context with "length", as the engine's does.
        limit = min(getattr(params, "max_tokens", len(words)), self.info.max_model_len - len(prompt))
        length = len(words) > limit
        words = words[: max(limit, 0)]
        start, first, out, ids = time.monotonic(), None, "", []
        try:
            for i, word in enumerate(words):
                await asyncio.sleep(self.delay)
                while self.hold_at is not None and i >= self.hold_at and request_id not in self._aborted:
                    self._check_alive()
                    await asyncio.sleep(0.01)
                self._check_alive()
                if request_id in self._aborted:
                    yield self._output(request_id, prompt, out, "", ids, start, first, "abort")
                    return
                first = first or time.monotonic()
                out += word
                ids.append(word_id(word))
                last = i == len(words) - 1
                reason = ("length" if length else "stop") if last else None
                yield self._output(request_id, prompt, out, word, ids, start, first, reason)
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    def iter_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """The blocking twin of stream: the same script, on an event loop of its own."""
        loop = asyncio.new_event_loop()
        outputs = self.stream(prompt, params, request_id)
        try:
            while True:
                try:
                    yield loop.run_until_complete(anext(outputs))
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(outputs.aclose())
            loop.close()

    def _output(
        self,
        request_id: str,
        prompt: list[int],
        text: str,
        delta: str,
        ids: list[int],
        start: float,
        first: float | None,
        reason: str | None,
    ) -> RequestOutput:
        n = len(ids)
        elapsed = time.monotonic() - (first or start)
        metrics = RequestMetrics(
            ttft_s=None if first is None else round(first - start, 3),
            prompt_tokens=len(prompt),
            cached_tokens=self.disk_tokens,
            generated_tokens=n,
            decode_tokens_per_s=n / elapsed if elapsed > 0 else None,
            disk_tokens=self.disk_tokens,
        )
        return RequestOutput(request_id, list(prompt), list(ids), text, delta, reason is not None, reason, metrics)

    async def abort(self, request_id: str) -> None:
        self._call()
        if request_id not in self._running:
            raise RequestError(f"no request {request_id!r} is in flight")
        self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        self._call()
        return EngineStats(
            running=len(self._running),
            waiting=0,
            tokens_per_s=0.0 if not self._running else 42.0,
            blocks_total=self.blocks_total,
            blocks_used=12 + 4 * len(self._running),
            blocks_cached=6,
            blocks_shared=3,
            prefix_hit_rate=0.5,
            spec_proposed_tokens=self.drafts[0] if self.drafts else None,
            spec_accepted_tokens=self.drafts[1] if self.drafts else None,
        )

    def kv_map(self, token_ids: list[int] | None = None) -> KVMap:
        """A fixed picture: 3 shared, 9 used, 6 cached, the rest free; the chat's first blocks lit."""
        self._call()
        states = [2] * 3 + [1] * 9 + [3] * 6 + [0] * (self.blocks_total - 18)
        highlight = list(range(min(len(token_ids or []) // BLOCK_SIZE, 12)))
        return KVMap(states, highlight, BLOCK_SIZE, 4096, 3 * 4096)

    def shutdown(self) -> None:
        self.shut_down = True
