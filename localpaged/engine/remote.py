"""RemoteEngine: the EngineClient protocol over any OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp).

It speaks through the official ``openai`` client (streaming, retries, error types), so chats, the
store, search, export, fork and regenerate work the same against a GPU box running vLLM as against
the local engine. What a remote server cannot do is said in ``info.capabilities``:

- Prompts are messages (chat completions); a string or token ids go to /v1/completions.
- Counting a conversation's tokens (``encode_chat``) goes through the server's /tokenize where it
  has one: ours and vLLM's take the messages; llama.cpp's takes text, so its /apply-template renders
  the chat first. Elsewhere (SGLang, Ollama) nothing is counted here and the server judges what fits.
- Continue sends the partial reply as a final assistant message: to ours and vLLM's with vLLM's
  ``continue_final_message`` fields; llama.cpp's server continues such a message on its own, and
  repeats it at the start of its answer, so that echo is cut off. Other servers: off, with a note.
- The KV pool is on the server: ``kv_map`` is empty and ``stats`` has no block figures.
- Figures are measured here (time to first token from sending the request, tok/s from the chunks);
  token counts and ``cached_tokens`` come from the server's usage (``stream_options.include_usage``).

Any failure to reach the server (refused, timed out, a stream cut off) is one RemoteEngineError
that names the URL; a request the server refuses is a RequestError with the server's own words.
Stopping a reply closes its HTTP stream, which vLLM, llama.cpp and ours all take as an abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import openai

from localpaged.engine.output import KVMap, RequestMetrics, RequestOutput
from localpaged.engine.protocol import EngineCapabilities, EngineInfo, EngineStats, Prompt
from localpaged.engine.request_registry import RequestRegistry, new_request_id
from localpaged.engine.tokenizer import check_messages
from localpaged.engine.vocabulary import Vocabulary
from localpaged.errors import ConfigError, LocalpagedError, RemoteEngineError, RequestError
from localpaged.sampling import MAX_TOKENS_LIMIT, SamplingParams, StructuredOutputs

CONNECT_TIMEOUT_S = 5.0  # a host that does not answer fails fast...
READ_TIMEOUT_S = 300.0  # ...but a long prompt on a busy server may take minutes to its first token
PROBE_TIMEOUT_S = 10.0  # the connect-time tools probe: one token; a server slower than this leaves tools on
# Tools reach a remote model in the generic format: a JSON-schema reply, so that is what the probe asks for.
PROBE_SCHEMA = {"type": "json_schema", "json_schema": {"name": "probe", "schema": {"type": "object"}}}
MAX_RETRIES = 1  # the client retries a failed connection (or a 429/5xx) once, after a short backoff

# How each server, known by the ``owned_by`` of its /v1/models card, continues a final assistant message.
CONTINUE_FIELDS = {
    "localpaged": {"continue_final_message": True, "add_generation_prompt": False},
    "vllm": {"continue_final_message": True, "add_generation_prompt": False},
    "llamacpp": {},  # continues it on its own, and repeats it first (ECHOES_PREFIX)
}
ECHOES_PREFIX = {"llamacpp"}
_END, _ABORTED = object(), object()  # what the async reader hands the consumer besides chunks


def base_url(url: str) -> str:
    """The OpenAI base URL (``.../v1``) of ``url``; a bare ``http://host:port`` gets ``/v1``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"backend {url!r} is not an http(s) URL; write e.g. http://127.0.0.1:8000/v1")
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") or "/v1", "", ""))


class RemoteEngine:
    """An EngineClient whose model runs behind an OpenAI-compatible server at ``url``."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None) -> None:
        """Connect: read the served model (``model``, or the first one listed), its context and what the server can do.

        A server that cannot be reached is a RemoteEngineError naming the URL; a ``model`` it does not
        serve is a ConfigError listing the ones it does.
        """
        self.url = base_url(url)
        self._root = self.url.removesuffix("/v1")
        # Never the client's fallback, $OPENAI_API_KEY: that key is for OpenAI, not for this server.
        self._client_args = {
            "base_url": self.url,
            "api_key": api_key or "EMPTY",
            "max_retries": MAX_RETRIES,
            "timeout": openai.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        }
        self._client = openai.OpenAI(**self._client_args)
        self._async: tuple[asyncio.AbstractEventLoop, openai.AsyncOpenAI] | None = None
        self._replies: RequestRegistry[_Reply] = RequestRegistry()
        self._closed = False
        card = self._model_card(model)
        self.server: str = getattr(card, "owned_by", None) or "unknown"  # "vllm", "llamacpp", "localpaged", ...
        self._model: str = card.id
        self._tokenize = self._find_tokenizer()
        context, device = self._context_length(card), f"remote engine {self.url}"
        self.info = EngineInfo(card.id, context, device, None, self._capabilities())

    # ----- what the front ends read ----------------------------------------------------

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The server's token ids of ``messages`` ending with the assistant's turn (its /tokenize)."""
        if self._tokenize is None:
            raise RequestError(f"{self.url} has no /tokenize, so its token counts are unknown here")
        return self._tokenize(check_messages(messages), tools)

    def vocabulary(self) -> Vocabulary | None:
        """None: the server's tokenizer is not here (its /tokenize counts, through encode_chat)."""
        return None

    def stats(self) -> EngineStats:
        """What is known here: the replies in flight and their tok/s; the server's pool is not visible."""
        rates = [reply.rate() for reply in self._replies.values()]
        return EngineStats(running=len(rates), waiting=0, tokens_per_s=sum(r for r in rates if r is not None))

    def prefetch(self, prompt: Prompt) -> int:
        """Nothing to load here: the server keeps its own KV cache (and any tier below it)."""
        return 0

    def kv_map(self, token_ids: list[int] | None = None) -> KVMap:
        """An empty map: the KV pool is on the server, not visible from here (info.capabilities.kv_pool is False)."""
        return KVMap(states=[], highlight=[], block_size=0, block_bytes=0, bytes_saved=0)

    # ----- streaming -------------------------------------------------------------------

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the reply's outputs as the server streams them; leaving early closes the stream (an abort).

        The HTTP side runs in a task of its own that feeds a queue, so ``abort`` ends the stream at
        once, even while the server is still busy with the prompt.
        """
        reply = self._open(prompt, params, request_id)
        loop = asyncio.get_running_loop()
        client = self._async_client(loop)
        items: asyncio.Queue[Any] = asyncio.Queue()

        async def read() -> None:
            try:
                async with await reply.create(client) as chunks:
                    async for chunk in chunks:
                        items.put_nowait(chunk)
                items.put_nowait(_END)
            except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it as ours
                items.put_nowait(self._error(exc))

        reader = asyncio.ensure_future(read())
        reply.wake = lambda: loop.call_soon_threadsafe(items.put_nowait, _ABORTED)
        try:
            while (item := await items.get()) not in (_END, _ABORTED):
                if isinstance(item, LocalpagedError):
                    raise item
                if (out := reply.take(item)) is not None:
                    yield out
            yield reply.final()
        finally:
            reader.cancel()  # leaving early: closing the response tells the server to stop
            await asyncio.gather(reader, return_exceptions=True)
            self._replies.discard(reply)

    def iter_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """The blocking twin of stream(); ``abort`` from another thread closes the HTTP stream."""
        reply = self._open(prompt, params, request_id)
        try:
            try:
                chunks = reply.create(self._client)
            except Exception as exc:  # noqa: BLE001 -- raised as ours
                raise self._error(exc) from None
            reply.wake = chunks.close
            with chunks:
                while not reply.aborted:
                    try:
                        chunk = next(chunks)
                    except StopIteration:
                        break
                    except Exception as exc:  # noqa: BLE001 -- a cut connection, or an abort closing it
                        if reply.aborted:
                            break
                        raise self._error(exc) from None
                    if (out := reply.take(chunk)) is not None:
                        yield out
            yield reply.final()
        finally:
            self._replies.discard(reply)

    async def abort(self, request_id: str) -> None:
        """Close the request's HTTP stream; its stream ends with finish_reason "abort", the text so far kept.

        Raises RequestError when no request with that id is in flight.
        """
        reply = self._replies.in_flight(request_id)
        reply.aborted = True
        reply.wake()

    def shutdown(self) -> None:
        """Close the connections; later requests are refused. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._replies.close(RequestError("the remote engine has been shut down; create a new RemoteEngine to go on"))
        self._client.close()
        if self._async is not None:
            loop, client = self._async
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile: nothing left open
                    asyncio.run_coroutine_threadsafe(client.close(), loop)

    # ----- connecting ------------------------------------------------------------------

    def _model_card(self, model: str | None) -> Any:
        try:
            cards = list(self._client.models.list().data)
        except Exception as exc:  # noqa: BLE001 -- raised as ours
            raise self._error(exc) from None
        if not cards:
            raise RemoteEngineError(f"{self.url} serves no model (its /v1/models list is empty)")
        if model is None:
            return cards[0]
        for card in cards:
            if card.id == model:
                return card
        served = ", ".join(repr(card.id) for card in cards)
        raise ConfigError(f"{self.url} does not serve the model {model!r}; it serves {served}")

    def _context_length(self, card: Any) -> int | None:
        """vLLM's and our /v1/models say max_model_len; llama.cpp's /props says its slots' n_ctx."""
        extra = card.model_extra or {}
        found = [extra.get("max_model_len")]
        if self.server == "llamacpp":
            props = self._optional("get", "/props")
            found.append((props or {}).get("default_generation_settings", {}).get("n_ctx"))
            found.append((extra.get("meta") or {}).get("n_ctx"))
        return next((n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0), None)

    def _find_tokenizer(self) -> Callable[[list[dict], list[dict] | None], list[int]] | None:
        """How this server counts a conversation: /tokenize with messages (ours, vLLM), or rendered first
        by /apply-template (llama.cpp, whose /tokenize ignores messages and answers no tokens); else None."""
        probe = [{"role": "user", "content": "Hello"}]
        if _token_list(self._optional("post", "/tokenize", {"model": self._model, "messages": probe})):
            return self._tokenize_messages
        rendered = self._optional("post", "/apply-template", {"messages": probe})
        if isinstance(rendered, dict) and isinstance(rendered.get("prompt"), str):
            return self._tokenize_rendered
        return None

    def _tokenize_messages(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        body = {"model": self._model, "messages": messages, **({"tools": tools} if tools else {})}
        return _token_list(self._post("/tokenize", body)) or []

    def _tokenize_rendered(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        body = {"messages": messages, **({"tools": tools} if tools else {})}
        prompt = self._post("/apply-template", body)["prompt"]
        return _token_list(self._post("/tokenize", {"content": prompt})) or []

    def _capabilities(self) -> EngineCapabilities:
        notes = {}
        if self._tokenize is None:
            notes["tokenize"] = "it has no /tokenize, so the server alone judges whether a chat fits its context"
        if self.server not in CONTINUE_FIELDS:
            notes["continue_reply"] = (
                "continue needs a server that takes a partial reply as an assistant prefix (localpaged, vLLM, "
                f"llama.cpp); this one calls itself {self.server!r}"
            )
        refusal = self._tools_refusal()
        if refusal is not None:
            notes["tools"] = f"it refuses JSON-schema replies, which tools need ({refusal})"
        return EngineCapabilities(
            token_prompts=False,
            tokenize=self._tokenize is not None,
            continue_reply=self.server in CONTINUE_FIELDS,
            kv_pool=False,
            tools=refusal is None,
            notes=notes,
        )

    def _tools_refusal(self) -> str | None:
        """The server's words where a one-token request for a JSON-schema reply (what a tool round asks of a
        remote model) is refused for it; None where it takes it. A probe that fails any other way leaves
        tools on: the real request's error will say more. Ours always takes them."""
        if self.server == "localpaged":
            return None
        body = {
            "model": self._model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "response_format": PROBE_SCHEMA,
        }
        try:
            self._client.with_options(timeout=PROBE_TIMEOUT_S, max_retries=0).post(
                "/chat/completions", cast_to=object, body=body
            )
        except openai.APIStatusError as exc:
            said = _server_message(exc)
            refused = any(word in said.lower() for word in ("response_format", "schema", "grammar"))
            return said if exc.status_code in (400, 422) and refused else None
        except Exception:  # noqa: BLE001 -- see the docstring: an unclear probe never turns tools off
            return None
        return None

    def _post(self, path: str, body: dict) -> Any:
        """POST to a path beside /v1 (/tokenize, /apply-template), errors as ours."""
        try:
            return self._client.post(self._root + path, cast_to=object, body=body)
        except Exception as exc:  # noqa: BLE001 -- raised as ours
            raise self._error(exc) from None

    def _optional(self, method: str, path: str, body: dict | None = None) -> Any:
        """A probe of an endpoint the server may not have: its JSON, or None where it answers with an error."""
        try:
            if method == "get":
                return self._client.get(self._root + path, cast_to=object)
            return self._client.post(self._root + path, cast_to=object, body=body)
        except openai.APIStatusError:
            return None
        except Exception as exc:  # noqa: BLE001 -- gone between two requests: raised as ours
            raise self._error(exc) from None

    def _async_client(self, loop: asyncio.AbstractEventLoop) -> openai.AsyncOpenAI:
        """The async client of this event loop (its connections belong to one loop)."""
        if self._async is None or self._async[0] is not loop:
            self._async = (loop, openai.AsyncOpenAI(**self._client_args))
        return self._async[1]

    # ----- one request -----------------------------------------------------------------

    def _open(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> _Reply:
        reply = _Reply(new_request_id(request_id), *self._request(prompt, params or SamplingParams()))
        self._replies.add(reply)
        return reply

    def _request(self, prompt: Prompt, params: SamplingParams) -> tuple[bool, dict, str | None]:
        """(chat?, the create() arguments, the prefix the server will echo) for ``prompt`` and ``params``."""
        if params.n != 1:  # a reply here is one choice; the server's n choices would interleave in one stream
            raise RequestError(
                f"n={params.n}: a remote engine streams one sample per request; send n requests with n=1 "
                "(with different seeds, if seeded)"
            )
        if params.logprobs is not None:  # OpenAI's logprobs name tokens by their text, never by their ids
            raise RequestError(
                "logprobs: a remote engine's logprobs name tokens by text, not by the ids RequestOutput carries; "
                "ask the server for them directly (its logprobs field), or leave logprobs at None"
            )
        body: dict[str, Any] = {
            "model": self._model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        # No limit as large as the context: OpenAI's "until the model stops or the context is full".
        if params.max_tokens < (self.info.max_model_len or MAX_TOKENS_LIMIT):
            body["max_tokens"] = params.max_tokens
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(params, name):
                body[name] = getattr(params, name)
        if params.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
        extra: dict[str, Any] = {}  # vLLM's extensions, which llama.cpp's server and ours take too
        if params.repetition_penalty != 1:
            extra["repetition_penalty"] = params.repetition_penalty
        if params.min_p:
            extra["min_p"] = params.min_p
        if params.structured is not None:
            _structured_fields(params.structured, body, extra)
        if params.top_k:
            extra["top_k"] = params.top_k
        if params.stop_token_ids:
            extra["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            extra["ignore_eos"] = True
        echo = None
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        if chat:
            messages = check_messages(prompt)
            if messages[-1]["role"] == "assistant":  # a reply to continue
                if not self.info.capabilities.continue_reply:
                    raise RequestError(
                        f"{self.url} cannot continue a reply: {self.info.capabilities.why_off('continue_reply')}"
                    )
                extra.update(CONTINUE_FIELDS[self.server])
                echo = messages[-1]["content"] if self.server in ECHOES_PREFIX else None
            body["messages"] = messages
        elif isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            if not prompt:
                raise RequestError("the prompt is empty")
            body["prompt"] = prompt
        else:
            raise RequestError(f"a prompt is text, token ids or chat messages, not {type(prompt).__name__}")
        if extra:
            body["extra_body"] = extra
        return chat, body, echo

    def _error(self, exc: BaseException) -> LocalpagedError:
        """One of our errors for anything the HTTP side raised, naming the URL."""
        if isinstance(exc, LocalpagedError):
            return exc
        if isinstance(exc, openai.APITimeoutError):
            return RemoteEngineError(f"cannot reach {self.url}: no answer within {READ_TIMEOUT_S:.0f} s")
        if isinstance(exc, openai.APIConnectionError):
            return RemoteEngineError(f"cannot reach {self.url}: {_reason(exc)}")
        if isinstance(exc, openai.APIStatusError):
            said, status = _server_message(exc), exc.status_code
            if status in (401, 403):
                return RemoteEngineError(
                    f"{self.url} refused the API key ({status}: {said}); pass the server's key with --api-key "
                    "or LOCALPAGED_API_KEY"
                )
            if 400 <= status < 500:
                return RequestError(f"{self.url} refused the request ({status}): {said}")
            return RemoteEngineError(f"{self.url} failed ({status}): {said}")
        if isinstance(exc, openai.APIError):  # an error event in the middle of a stream
            return RemoteEngineError(f"{self.url} failed mid-reply: {exc.message}")
        return RemoteEngineError(f"lost the connection to {self.url} mid-reply ({type(exc).__name__}: {exc})")


class _Reply:
    """One request's outputs, rebuilt from the server's chunks; what stream() and iter_stream() share."""

    def __init__(self, request_id: str, chat: bool, body: dict, echo: str | None) -> None:
        self.request_id = request_id
        self.chat = chat
        self.body = body
        self.echo = echo  # a continued reply the server repeats before going on (llama.cpp): cut off
        self.aborted = False
        self.wake: Callable[[], object] = lambda: None  # ends the stream's wait after an abort
        self.sent = time.perf_counter()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.pieces = 0
        self.raw = ""
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: Any = None

    def create(self, client: openai.OpenAI | openai.AsyncOpenAI) -> Any:
        """The streaming call, on the sync or the async client (an awaitable for the latter)."""
        endpoint = client.chat.completions if self.chat else client.completions
        return endpoint.create(**self.body)

    def take(self, chunk: Any) -> RequestOutput | None:
        """The output for a chunk, or None when it adds no text (the role, the finish, the usage)."""
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        if not chunk.choices:
            return None
        choice = chunk.choices[0]
        self.finish_reason = choice.finish_reason or self.finish_reason
        piece = (choice.delta.content if self.chat else choice.text) or ""
        if not piece:
            return None
        self.raw += piece
        if self.echo is not None:
            if len(self.raw) < len(self.echo) and self.echo.startswith(self.raw):
                return None  # maybe the echo, not whole yet
            self.raw = self.raw.removeprefix(self.echo)
            self.echo = None
        delta, self.text = self.raw[len(self.text) :], self.raw
        if not delta:
            return None
        self.pieces += 1
        self.last_at = time.perf_counter()
        self.first_at = self.first_at or self.last_at
        return self._output(delta, None)

    def final(self) -> RequestOutput:
        """The last output: finished, with the server's usage; RemoteEngineError if the stream just stopped."""
        if self.aborted:
            return self._output("", "abort")
        if self.finish_reason is None:
            raise RemoteEngineError("the server closed the stream before the reply finished; the text so far is kept")
        return self._output("", "length" if self.finish_reason == "length" else "stop")

    def rate(self) -> float | None:
        """Tokens per second after the first, counting a chunk as a token until the server's usage says more."""
        if self.first_at is None or self.last_at is None or self.last_at <= self.first_at:
            return None
        generated = self.usage.completion_tokens if self.usage is not None else self.pieces
        return (generated - 1) / (self.last_at - self.first_at)

    def _output(self, delta: str, finish_reason: str | None) -> RequestOutput:
        usage = self.usage
        details = getattr(usage, "prompt_tokens_details", None)
        metrics = RequestMetrics(
            ttft_s=None if self.first_at is None else self.first_at - self.sent,
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            cached_tokens=(getattr(details, "cached_tokens", None) or 0) if details is not None else 0,
            generated_tokens=usage.completion_tokens if usage is not None else self.pieces,
            decode_tokens_per_s=self.rate(),
        )
        finished = finish_reason is not None
        return RequestOutput(self.request_id, [], [], self.text, delta, finished, finish_reason, metrics)


def _structured_fields(spec: StructuredOutputs, body: dict, extra: dict) -> None:
    """A grammar on the wire: JSON ones as OpenAI's response_format (which vLLM, SGLang, llama.cpp and ours
    all take); a regex, choice or EBNF grammar as vLLM's structured_outputs (vLLM's and ours)."""
    kind = spec.kind
    if kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif kind == "json":
        schema = spec.json if isinstance(spec.json, dict) else json.loads(spec.json)  # type: ignore[arg-type]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    else:
        extra["structured_outputs"] = {kind: getattr(spec, kind)}


def _token_list(reply: Any) -> list[int] | None:
    tokens = reply.get("tokens") if isinstance(reply, dict) else None
    return tokens if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens) else None


def _reason(exc: BaseException) -> str:
    """The root cause of a connection error in a few words: "connection refused", "name or service not known"."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno).lower()
        if cause.__cause__ is None and cause.__context__ is None:
            break
        cause = cause.__cause__ or cause.__context__
    return str(cause) or "connection error"


def _server_message(exc: openai.APIStatusError) -> str:
    """The server's own words from an OpenAI-style error body ({"error": {"message": ...}} or {"message": ...})."""
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(inner, str):
            return inner
    return exc.message
