"""The FastAPI app: OpenAI's chat and text completions, tokenize/detokenize, models, health, metrics.

``build_app(engine)`` takes any EngineClient (an AsyncLLM in practice; tests pass theirs), and every
HTTP client shares that one engine: one continuous batch, one prefix cache, so a system prompt
that many clients send is computed once.

What a client sees when things go wrong is always OpenAI's error body with a 4xx/5xx status,
never a traceback, and it concerns that request alone:

- a malformed body or a bad field: 400 naming the field (``param``); pydantic's 422 is turned into
  that, and value ranges are SamplingParams' own checks, worded as the library words them;
- a prompt the context cannot hold: 400 with the limits. The engine refuses it before its first
  output, and the server waits for that first output before it answers, so even a streamed
  request gets a plain 400 rather than a 200 whose stream then breaks;
- the engine gone: 503; anything else: 500.

A client that goes away (closes a stream, or gives up on a non-streamed request) aborts its
request at once, so its KV blocks go back to the pool for everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from localpaged.chat.tool_calls import constraint
from localpaged.engine.protocol import EngineClient
from localpaged.errors import LocalpagedError, RequestError
from localpaged.server.anthropic import messages_router
from localpaged.server.choices import ChatChoice, CompletionChoice, ToolSetup
from localpaged.server.errors import APIError, bad_request, error_response, json_response, validation_error
from localpaged.server.guard import Guard
from localpaged.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from localpaged.server.state import ServerState
from localpaged.server.streaming import EventStream, chat_chunks, completion_chunks, usage

# What every refusal's body is (server/errors.py), in place of FastAPI's 422 that this server never sends.
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document, saying what the server answers a bad request: a 400 with OpenAI's error body."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
                responses["400"] = {"description": "A bad request: OpenAI's error body", "content": content}
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["Error"] = ERROR_SCHEMA
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(engine: EngineClient, *, api_key: str | None = None, allowed_hosts: Iterable[str] = ()) -> FastAPI:
    """The HTTP app over ``engine``; with ``api_key`` every path but /health and /metrics needs ``Bearer KEY``,
    without one only loopback Host names and ``allowed_hosts`` are answered."""
    state = ServerState(engine)
    # /openapi.json: the request bodies as the pydantic models declare them, for client generators and API testers.
    app = FastAPI(title="localpaged", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = partial(openapi_document, app)  # type: ignore[method-assign]
    app.state.localpaged = state
    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts)
    app.include_router(messages_router(state))  # Anthropic's Messages API (server/anthropic.py)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(exc), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind), exc.headers, path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        message = f"the server failed on this request ({type(exc).__name__}: {exc}); other requests go on"
        return error_response(APIError(500, message, type="server_error"), path=request.url.path)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine answers; 503 once it is gone or the server is stopping."""
        if state.stopping:
            raise APIError(503, "the server is shutting down", type="server_error")
        try:
            await asyncio.to_thread(engine.stats)
        except LocalpagedError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_dead") from None
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "localpaged",
        "max_model_len": state.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """One model's card (the openai client's ``models.retrieve``); 404 for a model not served here."""
        state.check_model(model_id)
        return json_response(card)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        params = body.sampling_params(state.max_model_len)
        plan = body.tool_plan()
        tools = None if plan is None else ToolSetup(plan, state.tool_format, body.legacy_functions)
        if tools is not None and (grammar := constraint(plan, tools.fmt)) is not None:
            params = dataclasses.replace(params, structured=grammar)
        state.check_params(params)
        texts = state.token_texts if params.logprobs is not None else None
        choices = [ChatChoice(i, tools if plan and plan.choice != "none" else None, texts) for i in range(params.n)]
        run = await state.start(await state.chat_prompt(body, tools), params, "chatcmpl", "messages")
        if body.stream:
            return EventStream(chat_chunks(state, run, body.include_usage, choices))
        finals = await run.final(request)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        whole = [choices[out.index].message(out) for out in finals]
        return json_response(state.envelope(run, "chat.completion", whole, usage(run)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        params = body.sampling_params(state.max_model_len)
        state.check_params(params)
        texts = state.token_texts if params.logprobs is not None else None
        choices = [CompletionChoice(i, texts) for i in range(params.n)]
        run = await state.start(body.prompt, params, "cmpl", "prompt")
        if body.stream:
            return EventStream(completion_chunks(state, run, body.include_usage, choices))
        finals = await run.final(request)
        if finals is None:
            return Response(status_code=499)
        whole = [choices[out.index].whole(out) for out in finals]
        return json_response(state.envelope(run, "text_completion", whole, usage(run)))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        """vLLM's /tokenize: a prompt as the engine encodes it, or a conversation under the chat template."""
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send either prompt (a string) or messages (a conversation), not both", "prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("send at least one message", "messages")
            try:
                tokens = await asyncio.to_thread(engine.encode_chat, body.conversation())
            except RequestError as exc:  # a message the template cannot take (text that is not Unicode)
                raise bad_request(str(exc), "messages") from None
        else:
            tokens = await asyncio.to_thread(state.encode, body.prompt or "")
        return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        state.check_model(body.model)
        return json_response({"prompt": await asyncio.to_thread(state.decode, body.tokens)})

    return app
