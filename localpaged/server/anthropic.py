"""Anthropic's Messages API over the same engine: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

What Claude-style agents and Anthropic's SDKs send and read: the request runs through the same
ServerState and Run as the OpenAI routes (one batch, one prefix cache, the same refusals), and
only the shapes differ: a ``message`` with content blocks and a stop_reason, its stream as
Anthropic's named events, and errors as ``{"type": "error", "error": {type, message}}`` (errors.py).
The key comes as ``x-api-key`` or as a Bearer token (guard.py); ``anthropic-version`` is accepted
whatever it says, since every version reads the fields served here the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from localpaged.engine.output import RequestOutput
from localpaged.errors import RequestError
from localpaged.server.anthropic_protocol import MessagesInput, MessagesRequest
from localpaged.server.errors import APIError, bad_request, json_response
from localpaged.server.state import Run, ServerState
from localpaged.server.streaming import EventStream

_json = msgspec.json.Encoder()


def messages_router(state: ServerState) -> APIRouter:
    """The Messages API's routes over ``state``'s engine."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        state.check_model(body.model)
        params = body.sampling_params(state.max_model_len)
        prompt = await state.conversation_prompt(body.conversation(), body.prefilled)
        run = await state.start(prompt, params, "msg", "messages")
        if body.stream:
            return EventStream(message_events(state, run, body.stop_sequences or [], params.max_tokens))
        final = await run.final(request)
        if final is None:
            return Response(status_code=499)  # nobody is listening
        reason, sequence = stop_reason(state, final, body.stop_sequences or [], params.max_tokens)
        content = [{"type": "text", "text": final.text}]
        return json_response(message(state, run, content, reason, sequence, usage(final)))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesInput) -> Response:
        """The prompt's tokens as /v1/messages would send them: ``{"input_tokens": N}``."""
        state.check_model(body.model)
        body.check()
        prompt = await state.conversation_prompt(body.conversation(), body.prefilled)
        if not body.prefilled:  # else the prompt is token ids already
            try:
                prompt = await asyncio.to_thread(state.engine.encode_chat, prompt)
            except RequestError as exc:  # a message the template cannot take (text that is not Unicode)
                raise bad_request(str(exc), "messages") from None
        return json_response({"input_tokens": len(prompt)})

    return router


def message(
    state: ServerState, run: Run, content: list[dict], reason: str | None, sequence: str | None, usage: dict
) -> dict:
    """A ``message`` object: the reply (content blocks) and why it stopped; ``reason`` None while it streams."""
    return {
        "id": f"msg_{run.request_id.removeprefix('msg-')}",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": state.model_name,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


def usage(out: RequestOutput) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt's tokens computed anew, ``cache_read_input_tokens``
    those the prefix cache served (their sum is the prompt), as Anthropic counts a cache hit."""
    prompt = out.metrics.prompt_tokens or len(out.prompt_token_ids)
    cached = out.metrics.cached_tokens
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(out.token_ids),
    }


def stop_reason(state: ServerState, out: RequestOutput, stops: list[str], max_tokens: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply.

    The engine says only "stop"; which stop string ended it is found in the reply's tokens decoded in
    full, where the stop string the text leaves out follows the text (one character of slack for
    tokenizers that drop a leading space when decoding from the first token).
    """
    if out.finish_reason == "length":
        if len(out.token_ids) < max_tokens:  # the context filled first
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if out.finish_reason == "stop" and stops:
        full = state.decode(out.token_ids, skip_special_tokens=True)
        start = max(0, len(out.text) - 1)
        found = [(at, s) for s in stops if (at := full.find(s, start)) >= 0]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def event(name: str, payload: dict) -> bytes:
    """One server-sent event as Anthropic sends them: its name, then its JSON (whose ``type`` is the name)."""
    return b"event: " + name.encode() + b"\ndata: " + _json.encode({"type": name, **payload}) + b"\n\n"


async def message_events(state: ServerState, run: Run, stops: list[str], max_tokens: int) -> AsyncIterator[bytes]:
    """The reply as Anthropic's stream: message_start, one text block (start, ping, deltas, stop),
    message_delta with the stop reason and usage, message_stop; a failure on the way is an ``error`` event."""
    try:
        first = run.last
        assert first is not None  # Run.start took the first output
        start_usage = {**usage(first), "output_tokens": 0}
        yield event("message_start", {"message": message(state, run, [], None, None, start_usage)})
        yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield event("ping", {})
        async for out in run:
            if out.delta:
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": out.delta}})
        final = run.last
        yield event("content_block_stop", {"index": 0})
        reason, sequence = stop_reason(state, final, stops, max_tokens)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event("message_delta", {"delta": delta, "usage": usage(final)})
        yield event("message_stop", {})
    except APIError as exc:  # the headers are out: the error travels as an event, as Anthropic's API sends it
        yield event("error", {"error": exc.anthropic_body()["error"]})
    finally:
        await run.close()
