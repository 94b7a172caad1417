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

from localpaged.chat.tool_calls import ToolPlan, constraint
from localpaged.engine.output import RequestOutput
from localpaged.engine.protocol import Prompt
from localpaged.errors import RequestError
from localpaged.server.anthropic_protocol import MessagesInput, MessagesRequest
from localpaged.server.anthropic_tools import ReplyBlocks
from localpaged.server.errors import APIError, bad_request, json_response
from localpaged.server.state import Run, ServerState
from localpaged.server.streaming import EventStream

_json = msgspec.json.Encoder()


def messages_router(state: ServerState) -> APIRouter:
    """The Messages API's routes over ``state``'s engine."""
    router = APIRouter()
    fmt = state.tool_format

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        state.check_model(body.model)
        plan = body.tool_plan()
        params = body.sampling_params(state.max_model_len, constraint(plan, fmt) if plan is not None else None)
        run = await state.start(await prompt(state, body, plan), params, "msg", "messages")
        blocks = ReplyBlocks(plan, fmt)
        stops = body.stop_sequences or []
        if body.stream:
            return EventStream(message_events(state, run, blocks, stops, params.max_tokens))
        finals = await run.final(request)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        (final,) = finals  # one sample: the Messages API has no n
        content = blocks.whole(final.text)
        reason, sequence = stop_reason(state, final, stops, params.max_tokens, blocks.made_calls)
        return json_response(message(state, run, content, reason, sequence, usage(final)))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesInput) -> Response:
        """The prompt's tokens as /v1/messages would send them: ``{"input_tokens": N}``."""
        state.check_model(body.model)
        ids = await prompt(state, body, body.tool_plan())
        if ids and isinstance(ids[0], dict):  # a conversation, which the engine would encode
            try:
                ids = await asyncio.to_thread(state.engine.encode_chat, ids)
            except RequestError as exc:  # a message the template cannot take (text that is not Unicode)
                raise bad_request(str(exc), "messages") from None
        return json_response({"input_tokens": len(ids)})

    return router


async def prompt(state: ServerState, body: MessagesInput, plan: ToolPlan | None) -> Prompt:
    """What the engine gets: the conversation (token ids after a prefill, or where tools or tool turns are
    rendered by the tool layer: ServerState.conversation_prompt)."""
    if body.prefilled and plan is not None and plan.choice != "none":  # as the OpenAI route refuses it
        raise bad_request(
            "a final assistant message (a prefill) is not served with tools; end with the user's turn",
            "messages",
        )
    return await state.conversation_prompt(body.conversation(), body.prefilled, plan)


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


def stop_reason(
    state: ServerState, out: RequestOutput, stops: list[str], max_tokens: int, made_calls: bool = False
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply; ``made_calls``: it called tools.

    The engine says only "stop"; which stop string ended it is found in the reply's tokens decoded in
    full, where the stop string the text leaves out follows the text (one character of slack for
    tokenizers that drop a leading space when decoding from the first token).
    """
    if out.finish_reason == "length":
        if len(out.token_ids) < max_tokens:  # the context filled first
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if out.finish_reason == "stop" and made_calls:
        return "tool_use", None
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


async def message_events(
    state: ServerState, run: Run, blocks: ReplyBlocks, stops: list[str], max_tokens: int
) -> AsyncIterator[bytes]:
    """The reply as Anthropic's stream: message_start, ping, its content blocks (each started, its deltas,
    stopped), message_delta with the stop reason and usage, message_stop; a failure on the way is an
    ``error`` event."""
    try:
        first = run.last
        assert first is not None  # Run.start took the first output
        start_usage = {**usage(first), "output_tokens": 0}
        yield event("message_start", {"message": message(state, run, [], None, None, start_usage)})
        yield event("ping", {})
        async for out in run:
            for chunk in blocks.events(out.delta, out.finished, event):
                yield chunk
        final = run.last
        assert final is not None
        reason, sequence = stop_reason(state, final, stops, max_tokens, blocks.made_calls)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event("message_delta", {"delta": delta, "usage": usage(final)})
        yield event("message_stop", {})
    except APIError as exc:  # the headers are out: the error travels as an event, as Anthropic's API sends it
        yield event("error", {"error": exc.anthropic_body()["error"]})
    finally:
        await run.close()
