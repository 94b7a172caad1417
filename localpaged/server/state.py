"""What the request handlers share (ServerState), and one request's way through the engine (Run)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import time
import uuid

from starlette.requests import Request

from localpaged.chat.tool_calls import ToolFormat, ToolPlan, detect_format, render
from localpaged.engine.output import RequestOutput
from localpaged.engine.protocol import EngineClient, Prompt
from localpaged.engine.vocabulary import Vocabulary
from localpaged.errors import EngineDeadError, LocalpagedError, RequestError
from localpaged.sampling import SamplingParams
from localpaged.server.choices import ToolSetup
from localpaged.server.errors import APIError, bad_request
from localpaged.server.metrics import ServerMetrics
from localpaged.server.protocol import ChatCompletionRequest, has_tool_turns
from localpaged.unicode_text import not_unicode

log = logging.getLogger(__name__)
STRUCTURED_REFUSAL = "structured outputs:"  # how the engine's refusal of a grammar begins


class ServerState:
    """What the handlers share: the engine, its resolved limits, the metrics, the requests in flight."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.model_name: str = engine.info.model_name
        self.max_model_len: int = engine.info.max_model_len
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.stats)
        self.runs: dict[str, Run] = {}
        self.stopping = False
        # One copy for /tokenize and the prompts encoded off the loop, one for the loop's logprob texts (made on
        # the first request for logprobs), so that neither waits for the other's lock. None: an engine whose
        # tokenizer is not here (a remote one).
        self.vocabulary = engine.vocabulary()
        chat_template = self.vocabulary.chat_template if self.vocabulary is not None else None
        self.tool_format: ToolFormat = detect_format(chat_template)

    @functools.cached_property
    def token_texts(self) -> Vocabulary | None:
        """The loop's copy of the tokenizer, for logprob texts (read on the event loop only)."""
        return self.engine.vocabulary()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist here; this server serves {self.model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def start(
        self, prompt: Prompt, params: SamplingParams, kind: str, param: str, grammar_param: str | None = None
    ) -> Run:
        """Submit a request and wait for its first output, so that a refusal is an HTTP error of its own.

        ``param``: the field a refused prompt is blamed on; ``grammar_param``: the one a refused grammar is."""
        if self.stopping:
            raise APIError(503, "the server is shutting down; send the request elsewhere", type="server_error")
        run = Run(self, prompt, params, f"{kind}-{uuid.uuid4().hex}", param)
        run.grammar_param = grammar_param
        await run.start()
        return run

    async def abort_all(self) -> None:
        """Stop every request in flight (the server is stopping): their blocks go back, their clients are told."""
        self.stopping = True

        async def abort(request_id: str) -> None:
            try:
                await self.engine.abort(request_id)
            except LocalpagedError:
                pass  # finished meanwhile, or the engine is gone: nothing left to stop

        await asyncio.gather(*(abort(request_id) for request_id in list(self.runs)))

    def check_params(self, params: SamplingParams) -> None:
        """What only the vocabulary can tell: the token ids of logit_bias (400 naming the field)."""
        vocab = self.vocabulary.size if self.vocabulary is not None else None
        if vocab is not None and any(t >= vocab for t in params.logit_bias):
            bad = sorted(t for t in params.logit_bias if t >= vocab)[:5]
            raise bad_request(
                f"logit_bias: token ids must be below {vocab}, the vocabulary size; got {bad}", "logit_bias"
            )

    def envelope(self, run: Run, kind: str, choices: list[dict], usage: dict | None) -> dict:
        body = {"id": run.request_id, "object": kind, "created": run.created, "model": self.model_name}
        body["choices"] = choices
        if usage is not None:
            body["usage"] = usage
        return body

    async def chat_prompt(self, body: ChatCompletionRequest, tools: ToolSetup | None) -> Prompt:
        """What the engine gets for a chat request: the conversation; token ids where tools or tool turns
        are rendered here (see localpaged/chat/tool_calls.py); with continue_final_message token ids too:
        the chat template up to the final message's turn, then that message's text with its turn left
        open (as vLLM renders it), so the reply goes on where the message stops."""
        plan = tools.plan if tools else None
        return await self.conversation_prompt(body.conversation(), body.continue_final_message, plan)

    async def conversation_prompt(
        self, conversation: list[dict], continue_final_message: bool, plan: ToolPlan | None = None
    ) -> Prompt:
        """The prompt of ``conversation`` as chat_prompt makes it (the Messages API's too)."""
        if plan is None and not has_tool_turns(conversation) and not continue_final_message:
            return conversation
        messages, definitions = render(conversation, plan, self.tool_format)
        head = messages[:-1] if continue_final_message else messages
        if not head:  # a template renders no turn of its own to go on from
            raise bad_request(
                "the final assistant message has nothing before it to answer; send a user message first", "messages"
            )
        try:
            ids = await asyncio.to_thread(self.engine.encode_chat, head, definitions)
        except RequestError as exc:
            raise bad_request(str(exc), "messages") from None
        if not continue_final_message:
            return ids
        return ids + await asyncio.to_thread(self.encode, conversation[-1]["content"] or "", literal=True)

    def encode(self, text: str, *, literal: bool = False) -> list[int]:
        """``text`` as the engine encodes a string prompt (no special tokens added).

        literal: control-token strings in ``text`` (``<|im_end|>``) are ordinary text, as in a message.
        """
        vocabulary = self._need_vocabulary()
        if reason := not_unicode(text):
            raise bad_request(f"the prompt cannot be encoded: {reason}", "prompt")
        return vocabulary.encode(text, literal=literal)

    def decode(self, tokens: list[int], *, skip_special_tokens: bool = False) -> str:
        vocabulary = self._need_vocabulary()
        bad = [t for t in tokens if not 0 <= t < vocabulary.size]
        if bad:
            raise bad_request(f"tokens must be ids in [0, {vocabulary.size}); got {bad[:5]}", "tokens")
        return vocabulary.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _need_vocabulary(self) -> Vocabulary:
        if self.vocabulary is None:
            raise APIError(501, "this engine does not expose its tokenizer", type="server_error")
        return self.vocabulary


class Run:
    """One request through the engine, as an async iterator of its outputs (those of all its ``n`` samples,
    each with its ``index``); records its metrics on the way.

    ``start`` takes the first output before any HTTP answer goes out. ``close`` (always called)
    leaves the engine's stream, which aborts the request if it has not finished.
    """

    def __init__(self, state: ServerState, prompt: Prompt, params: SamplingParams, request_id: str, param: str):
        self.state = state
        self.request_id = request_id
        self.param = param  # the field a refused prompt is blamed on: "messages" or "prompt"
        self.grammar_param: str | None = None  # the field that carried the grammar, if any
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.n = params.n
        self.tokens = 0  # generated, all samples together
        self.sample_tokens: dict[int, int] = {}
        self.finals: dict[int, RequestOutput] = {}  # each sample's last output, once it finished
        self.last: RequestOutput | None = None
        self._pending: RequestOutput | None = None
        self._counted = False  # in the requests counter, by finish reason
        self._outputs = state.engine.stream(prompt, params, request_id=request_id)
        state.runs[request_id] = self

    async def start(self) -> None:
        try:
            self._pending = await self._next()
        except BaseException:
            await self.close()
            raise

    def __aiter__(self) -> Run:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        if self.finished:
            raise StopAsyncIteration
        return await self._next()

    @property
    def finished(self) -> bool:
        return len(self.finals) >= self.n

    def outputs(self) -> list[RequestOutput]:
        """Every sample's final output, by index."""
        return [self.finals[i] for i in sorted(self.finals)]

    async def _next(self) -> RequestOutput:
        try:
            out = await self._outputs.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the engine ended the request without a final output", type="server_error") from None
        except LocalpagedError as exc:
            self._ended("error")
            raise self._error(exc) from None
        except Exception as exc:  # a bug of ours, not the client's doing: this request fails alone
            log.exception("request %s failed in the server", self.request_id)
            self._ended("error")
            raise APIError(500, f"the server failed ({type(exc).__name__}: {exc})", type="server_error") from None
        self._observe(out)
        # Stopping (SIGTERM, Ctrl-C) ends every open stream now: a fast engine may have generated the
        # whole reply before the abort reached it, and draining it to the client would hold the stop.
        if out.finish_reason == "abort" or self.state.stopping:
            raise APIError(503, "the server is shutting down; the reply was cut short", type="server_error")
        if out.finish_reason == "error":  # an engine that reports a failure as an output rather than raising
            raise APIError(500, out.error or "the request failed in the engine", type="server_error")
        return out

    async def final(self, request: Request) -> list[RequestOutput] | None:
        """Run to the end: each sample's final output; None if the client went away first (then it is aborted)."""
        drain = asyncio.ensure_future(self._drain())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({drain, gone}, return_when=asyncio.FIRST_COMPLETED)
            if drain.done():
                return drain.result()
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
            return None
        finally:
            gone.cancel()
            await self.close()

    async def _drain(self) -> list[RequestOutput]:
        async for _ in self:
            pass
        return self.outputs()

    async def close(self) -> None:
        if self.state.runs.pop(self.request_id, None) is None:
            return
        if not self.finished:
            self._ended("abort")
        await self._outputs.aclose()  # leaving the engine's stream early aborts the request

    def _observe(self, out: RequestOutput) -> None:
        metrics = self.state.metrics
        now = time.perf_counter()
        new = len(out.token_ids) - self.sample_tokens.get(out.index, 0)
        if new > 0:
            self.sample_tokens[out.index] = len(out.token_ids)
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
            self.tokens += new
            metrics.generation_tokens.inc(new)
        self.last = out
        if out.finished:
            self.finals[out.index] = out
        if out.finished and self.finished:
            if self.first_token_at is not None and self.tokens > 1:
                metrics.tpot.observe((now - self.first_token_at) / (self.tokens - 1))
            metrics.prompt_tokens.inc(out.metrics.prompt_tokens)
            self._ended(out.finish_reason or "stop")

    def _ended(self, reason: str) -> None:
        if not self._counted:
            self._counted = True
            self.state.metrics.requests.labels(finish_reason=reason).inc()

    def _error(self, exc: LocalpagedError) -> APIError:
        """The HTTP error for an engine exception: the request's own fault (400) or the server's (5xx)."""
        text = str(exc)
        if isinstance(exc, EngineDeadError):
            return APIError(503, text, type="server_error", code="engine_dead")
        if self.state.stopping or "has been shut down" in text:
            return APIError(503, "the server is shutting down; send the request elsewhere", type="server_error")
        # Before the first output, a RequestError is the engine refusing the input (prompt too long or
        # empty, a token id out of range); a failure while generating names the request ("request '...' failed").
        if isinstance(exc, RequestError) and self.last is None and not text.startswith(f"request {self.request_id!r}"):
            if text.startswith(STRUCTURED_REFUSAL) and self.grammar_param is not None:
                return bad_request(text, self.grammar_param)
            return bad_request(text, _param_named(text) or self.param)
        return APIError(500, text, type="server_error")


def _param_named(text: str) -> str | None:
    """The request field an engine refusal starts by naming ("stop_token_ids=[...]: ...", "n is not ..."), if any."""
    name = re.match(r"[a-z_]+", text)
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    return name.group() if name and name.group() in fields and text[name.end() : name.end() + 1] in "= :[" else None


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
