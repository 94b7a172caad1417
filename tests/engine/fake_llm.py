"""FakeLLM: a stand-in with the public shape of localpaged's LLM, for tests that need no model.

It "generates" a scripted reply one character (= one token) per step for every running
request, so the AsyncLLM and Session plumbing (streams, aborts, storage, errors) can be
tested in milliseconds and deterministically. It can also be told to slow down or to fail
a step, which a real engine cannot be made to do on demand.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from localpaged.engine.output import KVMap, RequestMetrics, RequestOutput
from localpaged.engine.protocol import LOCAL, EngineInfo, EngineStats, Prompt
from localpaged.engine.tokenizer import encode_chat
from localpaged.errors import RequestError
from localpaged.sampling import SamplingParams

BLOCK_SIZE = 16


@dataclass
class FakeConfig:
    max_model_len: int = 8192
    block_size: int = BLOCK_SIZE
    num_blocks: int = 256
    device: str = "cpu"
    dtype: str = "float32"


class FakeTokenizer:
    """One token per character: ids are code points; a chat template of ``<role>content`` lines."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

    def __len__(self) -> int:
        return 0x110000  # every code point

    def get_vocab(self) -> dict[str, int]:
        return {"a": ord("a")}  # every token is one character long

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    reply: str
    params: SamplingParams
    added_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    generated: list[int] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return -(-(len(self.prompt_ids) + len(self.generated)) // BLOCK_SIZE)


def default_reply(prompt_ids: list[int]) -> str:
    """A reply that depends on the prompt, so different sessions get different text."""
    return f"Reply #{sum(prompt_ids) % 1000} to a prompt of {len(prompt_ids)} tokens."


class FakeLLM:
    """Serves requests like LLM does, with text from `reply(prompt_ids)`, one character per step."""

    def __init__(
        self,
        reply: Callable[[list[int]], str] = default_reply,
        *,
        max_model_len: int = 8192,
        step_delay: float = 0.0,
    ) -> None:
        self.config = FakeConfig(max_model_len=max_model_len)
        self.info = EngineInfo("fake-llm", max_model_len, "cpu", BLOCK_SIZE, LOCAL)
        self.tokenizer = FakeTokenizer()
        self.reply = reply
        self.step_delay = step_delay
        self.fail_next_step: Exception | None = None  # raised by the next step(), once
        self.steps = 0
        self._requests: dict[str, _Request] = {}

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return encode_chat(self.tokenizer, messages, tools)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        if not prompt:
            raise RequestError("the prompt is empty")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt[0], dict):
            ids = self.encode_chat(prompt)  # type: ignore[arg-type]
        else:
            ids = list(prompt)  # type: ignore[arg-type]
        if len(ids) >= self.config.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {self.config.max_model_len}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._requests[request_id] = _Request(request_id, ids, self.reply(ids), params or SamplingParams())
        return request_id

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_next_step is not None:
            error, self.fail_next_step = self.fail_next_step, None
            raise error
        outputs = []
        for req in list(self._requests.values()):
            outputs.append(self._advance(req))
            if outputs[-1].finished:
                del self._requests[req.request_id]
        return outputs

    def _advance(self, req: _Request) -> RequestOutput:
        before = self.tokenizer.decode(req.generated)
        position = len(req.generated)
        script_done = position >= len(req.reply)
        if not script_done or req.params.ignore_eos:
            req.generated.append(ord(req.reply[position % len(req.reply)]))
        req.first_token_at = req.first_token_at or time.perf_counter()
        text = self.tokenizer.decode(req.generated)
        finish_reason = None
        if len(req.generated) >= req.params.max_tokens:
            finish_reason = "length"
        elif script_done and not req.params.ignore_eos:
            finish_reason = "stop"
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.generated),
            text=text,
            delta=text[len(before) :],
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            metrics=self._metrics(req),
        )

    def _metrics(self, req: _Request) -> RequestMetrics:
        elapsed = time.perf_counter() - (req.first_token_at or req.added_at)
        return RequestMetrics(
            ttft_s=(req.first_token_at - req.added_at) if req.first_token_at else None,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=0,
            generated_tokens=len(req.generated),
            decode_tokens_per_s=len(req.generated) / elapsed if elapsed > 0 else None,
        )

    def abort(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is None:
            raise RequestError(f"no request {request_id!r} is running")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        used = sum(req.blocks for req in self._requests.values())
        return EngineStats(
            running=len(self._requests),
            waiting=0,
            tokens_per_s=0.0,
            blocks_total=self.config.num_blocks,
            blocks_used=used,
            blocks_cached=0,
            blocks_shared=0,
            prefix_hit_rate=0.0,
        )

    def kv_map(self, token_ids: list[int] | None = None) -> KVMap:
        states = [0] * self.config.num_blocks
        for block in range(sum(req.blocks for req in self._requests.values())):
            states[block] = 1
        return KVMap(states, [], BLOCK_SIZE, block_bytes=1024, bytes_saved=0)
