"""AsyncLLM: the synchronous LLM stepping on its own thread, so many callers stream at once.

One engine step serves every running request (continuous batching), so requests must be
able to join and leave between steps while each caller waits on its own stream. A daemon
thread owns the stepping: callers post add/abort commands to an inbox that the thread
drains between steps, and the thread hands every output to its request's sink (an
asyncio.Queue fed through `loop.call_soon_threadsafe`, or a queue.Queue for plain
scripts). When no request is running the thread sleeps on a condition, it never spins.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from typing_extensions import Self

from localpaged.engine.llm import LLM
from localpaged.engine.output import RequestMetrics, RequestOutput
from localpaged.errors import LocalpagedError, RequestError
from localpaged.sampling import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict]
# What a sink receives: an output, or the exception that ends that request's stream.
Item = RequestOutput | BaseException
# Hands one item to a consumer; returns False when the consumer is gone for good.
Deliver = Callable[[Item], bool]

# How long shutdown() waits for a step in progress before leaving the daemon thread behind.
SHUTDOWN_JOIN_S = 10.0


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams | None
    deliver: Deliver


@dataclasses.dataclass
class _Abort:
    request_id: str
    # Set when a caller awaits the abort; None when a consumer simply walked away.
    done: concurrent.futures.Future | None = None
    # Only abort the stream owned by this sink (a consumer leaving must never abort
    # another request that reused its id); None aborts whichever stream has the id.
    owner: Deliver | None = None


@dataclasses.dataclass
class _Stream:
    """A request in flight, as the engine thread sees it."""

    deliver: Deliver
    last: RequestOutput | None = None


class AsyncLLM:
    """Serves many concurrent streams from one engine stepping on a background thread."""

    def __init__(self, model: str | None = None, *, llm: LLM | None = None, **engine_config: Any) -> None:
        """Load `model` (or wrap `llm`, an LLM or anything of its shape) and start the engine thread."""
        self._llm = llm if llm is not None else LLM(model, **engine_config)
        self._engine_lock = threading.RLock()  # every call into self._llm holds it
        self._wakeup = threading.Condition()  # guards _inbox and _stopping
        self._inbox: list[_Add | _Abort] = []
        self._stopping = False
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._thread = threading.Thread(target=self._serve, name="localpaged-engine", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    # ----- pass-throughs -------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._llm.tokenizer

    @property
    def config(self) -> Any:
        return self._llm.config

    @property
    def model_name(self) -> str:
        return self._llm.model_name

    def stats(self) -> dict:
        with self._engine_lock:
            return self._llm.stats()

    def kv_map(self, token_ids: list[int] | None = None) -> Any:
        with self._engine_lock:
            return self._llm.kv_map(token_ids)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        with self._engine_lock:
            return self._llm.encode_chat(messages)

    # ----- streaming -----------------------------------------------------------------

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them; the last one has finished=True.

        Must run inside an event loop. Leaving the loop early (break, cancel) aborts the
        request; a RequestError from add_request is raised here, to this consumer only.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Item] = asyncio.Queue()

        def deliver(item: Item) -> bool:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody will ever read this stream
                return False
            return True

        request_id = request_id or _new_request_id()
        self._post(_Add(request_id, prompt, params, deliver))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._post(_Abort(request_id, owner=deliver), quiet=True)

    def iter_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """The blocking twin of stream() for scripts without an event loop."""
        outputs: queue.Queue[Item] = queue.Queue()

        def deliver(item: Item) -> bool:
            outputs.put(item)
            return True

        request_id = request_id or _new_request_id()
        self._post(_Add(request_id, prompt, params, deliver))
        finished = False
        try:
            while not finished:
                item = outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._post(_Abort(request_id, owner=deliver), quiet=True)

    def generate_text(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Run one request to the end and return its final output (blocking)."""
        last = None
        for last in self.iter_stream(prompt, params):
            pass
        assert last is not None and last.finished
        return last

    async def abort(self, request_id: str) -> None:
        """Stop the request and free its KV blocks; its stream ends with finish_reason "abort".

        Raises RequestError when no request with that id is in flight.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Abort(request_id, done=done))
        await asyncio.wrap_future(done)

    # ----- lifecycle -----------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine thread; streams still in flight end with an error. Safe to call twice."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=SHUTDOWN_JOIN_S)
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _post(self, command: _Add | _Abort, quiet: bool = False) -> None:
        """Queue a command for the engine thread; raise if the engine is shut down, unless quiet."""
        with self._wakeup:
            if not self._stopping:
                self._inbox.append(command)
                self._wakeup.notify()
                return
        if not quiet:
            raise RequestError("the engine has been shut down; create a new AsyncLLM to serve requests")

    # ----- the engine thread ---------------------------------------------------------

    def _serve(self) -> None:
        while (commands := self._next_commands()) is not None:
            for command in commands:
                self._run(command)
            self._step()
        self._close_all()

    def _next_commands(self) -> list[_Add | _Abort] | None:
        """Take the inbox, first sleeping while there is neither work nor a command; None on shutdown."""
        with self._engine_lock:
            idle = not self._llm.has_unfinished_requests()
        with self._wakeup:
            while idle and not self._inbox and not self._stopping:
                self._wakeup.wait()
            if self._stopping:
                return None
            commands, self._inbox = self._inbox, []
        return commands

    def _run(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Add):
            self._add(command)
        else:
            self._abort(command)

    def _add(self, command: _Add) -> None:
        if command.request_id in self._streams:
            command.deliver(RequestError(f"request id {command.request_id!r} is already in flight; use another id"))
            return
        try:
            with self._engine_lock:
                self._llm.add_request(command.prompt, command.params, command.request_id)
        except Exception as exc:  # noqa: BLE001 -- bad input (RequestError) or not: it concerns this request only
            command.deliver(exc)
            return
        self._streams[command.request_id] = _Stream(command.deliver)

    def _abort(self, command: _Abort) -> None:
        stream = self._streams.get(command.request_id)
        if stream is None or (command.owner is not None and stream.deliver is not command.owner):
            if command.done is not None:
                command.done.set_exception(
                    RequestError(f"no request {command.request_id!r} is in flight (unknown id, or already finished)")
                )
            return
        del self._streams[command.request_id]
        try:
            with self._engine_lock:
                self._llm.abort(command.request_id)
        except Exception as exc:  # noqa: BLE001 -- delivered to the stream it concerns
            stream.deliver(exc)
            if command.done is not None:
                command.done.set_exception(exc)
            return
        stream.deliver(_aborted(command.request_id, stream.last))
        if command.done is not None:
            command.done.set_result(None)

    def _step(self) -> None:
        """One engine step, if there is work; its outputs go to their streams."""
        try:
            with self._engine_lock:
                if not self._llm.has_unfinished_requests():
                    return
                outputs = self._llm.step()
        except Exception as exc:
            log.exception("engine step failed; failing every request in flight")
            self._fail_all(exc)
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # added to the LLM directly, not through this AsyncLLM
                continue
            stream.last = output
            if output.finished:
                del self._streams[output.request_id]
            item = RequestError(output.error) if output.error is not None else output  # it alone failed
            if not stream.deliver(item) and not output.finished:
                self._abort(_Abort(output.request_id))

    def _fail_all(self, cause: Exception) -> None:
        """A step raised: end every stream with an error that says so, and free their blocks."""
        for request_id, stream in list(self._streams.items()):
            del self._streams[request_id]
            self._forget(request_id)
            error = LocalpagedError(
                f"the engine failed while serving this request ({type(cause).__name__}: {cause}); "
                "the request was stopped, new requests are still served"
            )
            error.__cause__ = cause
            stream.deliver(error)

    def _close_all(self) -> None:
        """On shutdown: end streams and pending commands with an error, so no caller waits forever."""
        with self._wakeup:
            pending, self._inbox = self._inbox, []
        for command in pending:
            if isinstance(command, _Add):
                command.deliver(_shut_down())
            elif command.done is not None:
                command.done.set_exception(_shut_down())
        for request_id, stream in list(self._streams.items()):
            self._forget(request_id)
            stream.deliver(_shut_down())
        self._streams.clear()

    def _forget(self, request_id: str) -> None:
        """Abort in the LLM, tolerating a request it no longer knows or an engine in a bad state."""
        try:
            with self._engine_lock:
                self._llm.abort(request_id)
        except Exception:
            log.debug("abort of %s after failure/shutdown did not succeed", request_id, exc_info=True)


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def _shut_down() -> RequestError:
    """A fresh error per consumer: one exception object raised in many tasks would tangle tracebacks."""
    return RequestError("the engine was shut down before this request finished")


def _aborted(request_id: str, last: RequestOutput | None) -> RequestOutput:
    """The final output of an aborted request: everything generated so far, nothing new."""
    if last is not None:
        return dataclasses.replace(last, delta="", finished=True, finish_reason="abort")
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=[],
        token_ids=[],
        text="",
        delta="",
        finished=True,
        finish_reason="abort",
        metrics=RequestMetrics(
            ttft_s=None, prompt_tokens=0, cached_tokens=0, generated_tokens=0, decode_tokens_per_s=None
        ),
    )
