"""Streamed replies: server-sent events (``data: {...}``, then ``data: [DONE]``) as OpenAI's API sends them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from localpaged.engine.output import RequestOutput
from localpaged.server.errors import APIError
from localpaged.server.state import Run, ServerState

DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends, so the request is aborted."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


async def chat_chunks(state: ServerState, run: Run, include_usage: bool) -> AsyncIterator[bytes]:
    """``chat.completion.chunk`` events: the role, then text deltas, the finish reason, usage if asked, [DONE]."""
    head = {"id": run.request_id, "object": "chat.completion.chunk", "created": run.created, "model": state.model_name}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse({**head, "choices": [choice], **extra})

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for out in run:
            if out.delta:
                yield chunk({"content": out.delta})
            if out.finished:  # in a chunk of its own with an empty delta, as OpenAI sends it
                yield chunk({}, out.finish_reason)
        if include_usage and run.last is not None:
            yield sse({**head, "choices": [], "usage": usage(run.last)})
        yield DONE
    except APIError as exc:  # the headers are out: the error travels as an event, as OpenAI's API sends it
        yield sse(exc.body())
        yield DONE
    finally:
        await run.close()


async def completion_chunks(state: ServerState, run: Run, include_usage: bool) -> AsyncIterator[bytes]:
    """``text_completion`` events: text deltas, the finish reason, usage if asked, [DONE]."""
    head = {"id": run.request_id, "object": "text_completion", "created": run.created, "model": state.model_name}
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return sse({**head, "choices": [choice], **extra})

    try:
        async for out in run:
            if out.delta:
                yield chunk(out.delta)
            if out.finished:  # in a chunk of its own, as OpenAI sends it
                yield chunk("", out.finish_reason)
        if include_usage and run.last is not None:
            yield sse({**head, "choices": [], "usage": usage(run.last)})
        yield DONE
    except APIError as exc:
        yield sse(exc.body())
        yield DONE
    finally:
        await run.close()


def usage(out: RequestOutput) -> dict:
    prompt = out.metrics.prompt_tokens or len(out.prompt_token_ids)
    completion = len(out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.metrics.cached_tokens},
    }
