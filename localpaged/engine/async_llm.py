"""AsyncLLM: the front end of the engine core, so that many callers stream at once.

One engine step serves every running request (continuous batching), so requests join and leave
between steps while each caller waits on its own stream. The core runs in its own process by
default (``engine_process=False`` runs it on a thread of this one, for tests and debugging); see
localpaged.engine.core for why. Either way the front end does the same: it sends adds, aborts and
calls, and a dispatcher turns each message from the core into the outputs of the streams it names
(an asyncio.Queue fed through ``loop.call_soon_threadsafe``, or a queue.Queue for scripts).

The tokenizer is loaded here too (a copy of its own), so ``encode_chat`` (every turn, every status
refresh) never waits for an engine step, and every prompt is encoded and checked against the context
here: the core is sent token ids only, so no prompt costs its step loop more than its own tokens do.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import dataclasses
import itertools
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from localpaged.config import EngineConfig
from localpaged.engine import messages as m
from localpaged.engine.core_client import CoreProcess, CoreThread
from localpaged.engine.output import KVMap, RequestMetrics, RequestOutput, TokenLogprob
from localpaged.engine.protocol import EngineInfo, EngineStats, Prompt
from localpaged.engine.request_registry import RequestRegistry, new_request_id
from localpaged.engine.tokenizer import (
    check_messages,
    check_prompt_length,
    encode_chat,
    encode_prompt,
    max_prompt_chars,
)
from localpaged.engine.vocabulary import Vocabulary
from localpaged.errors import EngineDeadError, LocalpagedError, RequestError
from localpaged.models import Progress
from localpaged.sampling import SamplingParams

if TYPE_CHECKING:
    from typing import Self

# What a consumer receives: an output, or the exception that ends its stream.
Item = RequestOutput | BaseException
# Hands one item to a consumer; returns False when the consumer is gone for good.
Deliver = Callable[[Item], bool]


@dataclasses.dataclass
class _Sample:
    """One sample's outputs so far, rebuilt from the core's deltas."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    last: RequestOutput | None = None


@dataclasses.dataclass
class _Stream:
    """A request in flight, as the front end sees it: each of its ``n`` samples' outputs so far."""

    request_id: str
    deliver: Deliver
    n: int = 1
    ended: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    samples: dict[int, _Sample] = dataclasses.field(default_factory=dict)
    finished: set[int] = dataclasses.field(default_factory=set)  # indices of the samples that have finished

    @property
    def done(self) -> bool:
        return len(self.finished) == self.n

    def update(self, out: m.Output) -> RequestOutput:
        if out.prompt_token_ids is not None:
            self.prompt_token_ids = out.prompt_token_ids
        sample = self.samples.setdefault(out.index, _Sample())
        sample.token_ids.extend(out.new_token_ids)
        sample.text += out.delta
        if out.new_logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + out.new_logprobs
        if out.finished:
            self.finished.add(out.index)
        sample.last = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(sample.token_ids),
            text=sample.text,
            delta=out.delta,
            finished=out.finished,
            finish_reason=out.finish_reason,
            metrics=out.metrics,
            error=out.error,
            logprobs=sample.logprobs,
            index=out.index,
        )
        return sample.last

    def aborted(self) -> list[RequestOutput]:
        """The final outputs of an aborted request's unfinished samples: everything generated so far, nothing new."""
        outputs = []
        for index in range(self.n):
            if index in self.finished:
                continue
            last = self.samples[index].last if index in self.samples else None
            if last is not None:
                outputs.append(dataclasses.replace(last, delta="", finished=True, finish_reason="abort"))
            else:
                metrics = RequestMetrics(
                    ttft_s=None, prompt_tokens=0, cached_tokens=0, generated_tokens=0, decode_tokens_per_s=None
                )
                outputs.append(RequestOutput(self.request_id, [], [], "", "", True, "abort", metrics, index=index))
        return outputs


class _Consumer:
    """What stream() and iter_stream() share; they differ only in how they wait for the next item."""

    def __init__(self, engine: AsyncLLM, stream: _Stream) -> None:
        self.engine = engine
        self.stream = stream
        self.unfinished = stream.n  # samples whose last output this consumer has not taken yet
        self.finished = False

    def take(self, item: Item) -> RequestOutput:
        """The next output, or raise the error that ends the stream (and, by ``close``, the other samples)."""
        if isinstance(item, BaseException):
            self.finished = self.stream.ended.done()
            raise item
        self.unfinished -= item.finished
        self.finished = self.unfinished == 0
        return item

    def close(self) -> None:
        """Leaving before the end (break, cancel, close, an exception) aborts the request."""
        if not self.finished:
            self.engine._walk_away(self.stream)


class AsyncLLM:
    """Serves many concurrent streams from one engine core; an EngineClient."""

    def __init__(
        self,
        model: str | None = None,
        *,
        llm: Any = None,
        engine_process: bool | None = None,
        progress: Progress | None = None,
        **engine_config: Any,
    ) -> None:
        """Start the engine core for `model` in its own process, or (``engine_process=False``) on a thread.

        ``engine_process=None`` takes $LOCALPAGED_ENGINE_PROCESS (``0`` runs the core on a thread: for
        debugging, and to measure the difference), else True.

        ``llm`` wraps an existing LLM, or anything of its shape, on a thread of this process (tests).
        Start-up errors are the engine's own: a bad model path is a ModelNotFoundError, and so on.
        """
        self._streams: RequestRegistry[_Stream] = RequestRegistry()
        self._lock = threading.Lock()  # guards _calls, _closed
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._closed: LocalpagedError | None = None  # why nothing more can be served
        self._stopping = False
        self._spare_vocabulary: Vocabulary | None = None  # a copy made while the core loaded, for vocabulary()
        if engine_process is None:
            engine_process = os.environ.get("LOCALPAGED_ENGINE_PROCESS", "1") != "0"
        if llm is None and engine_process:
            self.config = EngineConfig(model=model, **engine_config)  # checked here, before a process starts
            self._start_process(dataclasses.asdict(self.config), progress)
        else:
            if llm is None:
                from localpaged.engine.llm import LLM

                llm = LLM(model, progress=progress, **engine_config)
            self.config, self.info = llm.config, llm.info
            # A copy: the core thread detokenizes with the LLM's own, and a fast tokenizer used from two
            # threads at once fails with "Already borrowed".
            self.tokenizer = copy.deepcopy(llm.tokenizer)
            self._core: CoreProcess | CoreThread = CoreThread(llm, self._dispatch, self._on_core_exit)
        self._tokenizer_lock = threading.Lock()  # the UI thread, a status refresh and streams may encode at once
        self._max_prompt_chars = max_prompt_chars(self.tokenizer, self.info.max_model_len)
        atexit.register(self.shutdown)

    def _start_process(self, config: dict, progress: Progress | None) -> None:
        from localpaged.engine.tokenizer import load_front_end_tokenizer, load_tokenizer, probe_ids

        def load(folder: str) -> tuple[Any, Vocabulary]:
            tokenizer = load_front_end_tokenizer(folder)
            return tokenizer, Vocabulary(tokenizer)  # a copy takes a good part of a second: made while waiting

        # The tokenizer loads here while the core loads the weights.
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="localpaged-tokenizer")
        tokenizer: list[concurrent.futures.Future] = []
        try:
            core = CoreProcess(config, progress, lambda folder: tokenizer.append(loader.submit(load, folder)))
            try:
                self.tokenizer, self._spare_vocabulary = tokenizer[0].result()
                if probe_ids(self.tokenizer) != core.ready.probe_ids:  # a tokenizer class with its own ways
                    self.tokenizer, self._spare_vocabulary = load_tokenizer(core.ready.model_folder), None
            except BaseException:
                core.kill()
                raise
        finally:
            loader.shutdown(wait=False)
        self.info = EngineInfo.local(core.ready.model_name, core.ready.resolved)
        self._core = core
        core.serve(self._dispatch, self._on_core_exit)

    # ----- what the front ends read ----------------------------------------------------

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn.

        Checked first (RequestError naming the message); encoded here, never in the core.
        """
        messages = check_messages(messages)
        with self._tokenizer_lock:
            return encode_chat(self.tokenizer, messages, tools)

    def vocabulary(self) -> Vocabulary | None:
        """A copy of the front end's tokenizer, for the caller's own use."""
        with self._tokenizer_lock:
            spare, self._spare_vocabulary = self._spare_vocabulary, None
            return spare or Vocabulary(self.tokenizer)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        """``prompt`` as token ids, encoded and checked against the context here, before the core sees it.

        Text that could not fit the context is refused by its length, before any time goes into encoding it.
        """
        with self._tokenizer_lock:
            ids = encode_prompt(self.tokenizer, prompt, self._max_prompt_chars)
        check_prompt_length(len(ids), self.info.max_model_len)
        return ids

    def _request_ids(self, prompt: Prompt, params: SamplingParams | None) -> list[int]:
        """``_prompt_ids``, after checking what else the request carries that the core would refuse: a
        grammar xgrammar cannot parse is a RequestError here, so the core never gets one."""
        if isinstance(params, SamplingParams) and params.structured is not None:
            from localpaged.engine.structured import check_structured

            check_structured(params.structured)
        return self._prompt_ids(prompt)

    def stats(self) -> EngineStats:
        """The engine's figures (blocks, prefix hit rate, queues, tok/s) as of the end of its last step."""
        return msgspec.convert(self._call("stats"), EngineStats)

    def kv_map(self, token_ids: list[int] | None = None) -> KVMap:
        return msgspec.convert(self._call("kv_map", token_ids), KVMap)

    def prefetch(self, prompt: Prompt) -> int:
        """Have the engine read ``prompt``'s prefix blocks from its disk tier now; the number of tokens read."""
        return self._call("prefetch", self._prompt_ids(prompt))

    # ----- streaming -------------------------------------------------------------------

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them; each sample's last one has finished=True.

        With ``params.n`` > 1 the outputs of the n samples come interleaved, told apart by ``index``, and
        the stream ends once all n have finished. Must run inside an event loop. Leaving early (break, cancel) aborts the request; an error
        that concerns this request (bad input, the engine died) is raised here, to this consumer only.
        """
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Item] = asyncio.Queue()

        def deliver(item: Item) -> bool:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody will ever read this stream
                return False
            return True

        ids = await asyncio.to_thread(self._request_ids, prompt, params)  # off the event loop: other streams go on
        consumer = self._open(ids, params, request_id, deliver)
        try:
            while not consumer.finished:
                yield consumer.take(await items.get())
        finally:
            consumer.close()

    def iter_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """The blocking twin of stream() for scripts without an event loop."""
        items: queue.Queue[Item] = queue.Queue()

        def deliver(item: Item) -> bool:
            items.put(item)
            return True

        consumer = self._open(self._request_ids(prompt, params), params, request_id, deliver)
        try:
            while not consumer.finished:
                yield consumer.take(items.get())
        finally:
            consumer.close()

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
        stream = self._streams.in_flight(request_id)
        self._send(m.Abort(request_id))
        await asyncio.wrap_future(stream.ended)

    # ----- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine core; streams still in flight end with an error. Safe to call twice."""
        atexit.unregister(self.shutdown)
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._core.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ----- towards the core ------------------------------------------------------------

    def _open(
        self, prompt: list[int], params: SamplingParams | None, request_id: str | None, deliver: Deliver
    ) -> _Consumer:
        stream = _Stream(new_request_id(request_id), deliver, n=params.n if params is not None else 1)
        self._streams.add(stream)
        fields = None if params is None else dataclasses.asdict(params)
        try:
            self._send(m.Add(stream.request_id, prompt, fields))
        except BaseException:
            self._streams.discard(stream)
            raise
        return _Consumer(self, stream)

    def _walk_away(self, stream: _Stream) -> None:
        """A consumer left early: abort its request, unless that id now belongs to someone else."""
        if self._streams.get(stream.request_id) is not stream:
            return  # it ended meanwhile (or the engine closed)
        self._send(m.Abort(stream.request_id), quiet=True)

    def _call(self, method: str, *args: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._send(m.Call(call_id, method, list(args)))
        return future.result()

    def _send(self, message: m.Add | m.Abort | m.Call, quiet: bool = False) -> None:
        try:
            payload = m.encode(message)
        except (TypeError, ValueError, OverflowError) as exc:  # what msgspec cannot carry to the core
            raise RequestError(_unsendable(exc)) from None
        try:
            self._core.send(payload)
        except OSError:
            if not quiet:
                raise self._closed or _shut_down() from None

    # ----- from the core (on its thread, or on the reader thread) ----------------------

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, m.StepOutputs):
            for out in message.outputs:
                self._on_output(out)
        elif isinstance(message, m.Aborted):
            stream = self._end(message.request_id)
            if stream is not None:
                for output in stream.aborted():
                    stream.deliver(output)
        elif isinstance(message, m.RequestFailed):
            stream = self._end(message.request_id)
            if stream is not None:
                stream.deliver(m.error_from(message.error_type, message.message))
        elif isinstance(message, m.Reply):
            with self._lock:
                future = self._calls.pop(message.call_id, None)
            if future is not None and message.error is not None:
                future.set_exception(LocalpagedError(f"the engine could not answer: {message.error}"))
            elif future is not None:
                future.set_result(message.value)

    def _on_output(self, out: m.Output) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        output = stream.update(out)
        if stream.done:
            self._end(out.request_id)
        delivered = stream.deliver(RequestError(out.error) if out.error is not None else output)
        if not delivered and not stream.done:
            self._walk_away(stream)

    def _end(self, request_id: str) -> _Stream | None:
        stream = self._streams.pop(request_id)
        if stream is not None:
            stream.ended.set_result(None)
        return stream

    def _on_core_exit(self) -> None:
        """The core stopped: a shutdown if we asked for one, else it died. Nobody is left waiting."""
        if self._stopping:
            closed: LocalpagedError = _shut_down()
        else:
            closed = EngineDeadError(
                f"the engine core process died ({self._core.exit_cause()}); what was generated so far is kept. "
                "Start a new engine to go on (in the app: restart; in a script: create a new AsyncLLM)"
            )
        streams = self._streams.close(closed)
        with self._lock:
            self._closed = closed
            calls, self._calls = list(self._calls.values()), {}
        for stream in streams:
            stream.ended.set_result(None)
            stream.deliver(_copy(closed))
        for future in calls:
            future.set_exception(_copy(closed))


def _unsendable(exc: Exception) -> str:
    """Why a request cannot go to the core: its prompt is token ids by now, so something it carries."""
    return (
        f"the request cannot be sent to the engine ({type(exc).__name__}: {exc}); token ids are whole numbers "
        "below the vocabulary size, and sampling values are plain numbers, text and lists of them"
    )


def _shut_down() -> RequestError:
    return RequestError("the engine has been shut down; create a new AsyncLLM to serve requests")


def _copy(error: LocalpagedError) -> LocalpagedError:
    """A fresh exception per consumer: one object raised in many tasks would tangle tracebacks."""
    return type(error)(str(error))
