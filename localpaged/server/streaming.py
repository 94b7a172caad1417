"""Streamed replies: server-sent events (``data: {...}``, then ``data: [DONE]``) as OpenAI's API sends them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from localpaged.server.choices import ChatChoice, CompletionChoice
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


async def chat_chunks(
    state: ServerState, run: Run, include_usage: bool, choices: list[ChatChoice]
) -> AsyncIterator[bytes]:
    """``chat.completion.chunk`` events: each choice's role, then its text (or tool call) deltas and its
    finish reason, each chunk naming its choice's index; usage if asked, [DONE]."""
    head = {"id": run.request_id, "object": "chat.completion.chunk", "created": run.created, "model": state.model_name}
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: dict) -> bytes:
        return sse({**head, "choices": [choice], **extra})

    try:
        for choice in choices:
            yield chunk(
                {
                    "index": choice.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        async for out in run:
            for piece in choices[out.index].deltas(out):
                yield chunk(piece)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(run)})
        yield DONE
    except APIError as exc:  # the headers are out: the error travels as an event, as OpenAI's API sends it
        yield sse(exc.body())
        yield DONE
    finally:
        await run.close()


async def completion_chunks(
    state: ServerState, run: Run, include_usage: bool, choices: list[CompletionChoice]
) -> AsyncIterator[bytes]:
    """``text_completion`` events: each choice's text deltas and finish reason, usage if asked, [DONE]."""
    head = {"id": run.request_id, "object": "text_completion", "created": run.created, "model": state.model_name}
    extra = {"usage": None} if include_usage else {}

    try:
        async for out in run:
            for piece in choices[out.index].deltas(out):
                yield sse({**head, "choices": [piece], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(run)})
        yield DONE
    except APIError as exc:
        yield sse(exc.body())
        yield DONE
    finally:
        await run.close()


def usage(run: Run) -> dict:
    """The request's token counts: the prompt once, the completion tokens of every sample."""
    outs = run.outputs() or ([run.last] if run.last is not None else [])
    first = outs[0] if outs else None
    prompt = (first.metrics.prompt_tokens or len(first.prompt_token_ids)) if first is not None else 0
    completion = sum(len(out.token_ids) for out in outs)
    cached = first.metrics.cached_tokens if first is not None else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
