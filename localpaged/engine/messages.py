"""The messages between AsyncLLM (the front end) and the engine core, and the channel that carries them.

One message per engine step carries every request's new tokens and text (not one per token per
request); adds, aborts and calls go the other way. Messages are msgspec structs encoded as
MessagePack: typed, checked when decoded, and unable to run code on either side (no pickle crosses
the process boundary). The same encoded bytes travel in both modes: over a socketpair to the core
process, or through a queue to the core thread (``engine_process=False``), so the tests of one mode
cover the codec of the other.

A frame on the socket is a 4-byte little-endian length and the payload.
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Any

import msgspec

from localpaged import errors
from localpaged.config import ResolvedConfig
from localpaged.engine.output import FinishReason, RequestMetrics, TokenLogprob

# ----- front end -> core ------------------------------------------------------------------


class Start(msgspec.Struct, tag=True):
    """The first message: build the engine from these EngineConfig fields."""

    config: dict[str, Any]


class Add(msgspec.Struct, tag=True):
    request_id: str
    prompt: list[int]  # encoded and checked against the context by the front end; the core checks the ids
    params: dict[str, Any] | None  # SamplingParams fields; rebuilt (and checked) in the core


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Call(msgspec.Struct, tag=True):
    """Ask the engine for ``stats()``, ``kv_map(*args)`` or ``prefetch(*args)``; answered between two steps."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True):
    pass


ToCore = Start | Add | Abort | Call | Shutdown

# ----- core -> front end ------------------------------------------------------------------


class Progress(msgspec.Struct, tag=True):
    """Start-up progress, for the loading screen and the CLI's start-up line."""

    message: str
    fraction: float | None


class Resolved(msgspec.Struct, tag=True):
    """The model's folder is known: the front end loads its tokenizer while the core loads the weights."""

    model_folder: str


class Ready(msgspec.Struct, tag=True):
    """The engine is built: what the front end shows and needs (what the engine settled on)."""

    model_name: str
    model_folder: str
    resolved: ResolvedConfig
    probe_ids: list[int] | None  # the tokenizer's ids of tokenizer.PROBE, to check the front end's copy


class StartFailed(msgspec.Struct, tag=True):
    error_type: str  # the name of one of localpaged.errors' classes
    message: str


class Output(msgspec.Struct):
    """One sample's progress in one step: only what is new, so a long reply costs the same per step."""

    request_id: str
    new_token_ids: list[int]
    delta: str
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    prompt_token_ids: list[int] | None = None  # sent with the sample's first output only
    error: str | None = None
    new_logprobs: list[TokenLogprob] | None = None  # one per new token id, when the request asked for logprobs
    index: int = 0  # which of the request's samples


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[Output]


class Aborted(msgspec.Struct, tag=True):
    """The request was aborted and its blocks are free."""

    request_id: str


class RequestFailed(msgspec.Struct, tag=True):
    """The request ended with an error that concerns it alone (bad input, or a failed step)."""

    request_id: str
    error_type: str
    message: str


class Reply(msgspec.Struct, tag=True):
    call_id: int
    value: Any = None
    error: str | None = None


FromCore = Progress | Resolved | Ready | StartFailed | StepOutputs | Aborted | RequestFailed | Reply


def error_from(error_type: str, message: str) -> errors.LocalpagedError:
    """Our exception of that name (so a bad model path is still a ModelNotFoundError), else the base class."""
    cls = getattr(errors, error_type, None)
    if isinstance(cls, type) and issubclass(cls, errors.LocalpagedError):
        return cls(message)
    return errors.LocalpagedError(f"{error_type}: {message}" if error_type != "LocalpagedError" else message)


_encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


_LENGTH = 4
_READ_CHUNK = 1 << 20


class Channel:
    """Framed messages over a connected stream socket; sends from any thread, receives from one."""

    def __init__(self, sock: socket.socket, decoder: msgspec.msgpack.Decoder) -> None:
        self.sock = sock
        self.decoder = decoder
        self._buffer = bytearray()
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, payload: bytes) -> None:
        """Send one encoded message; OSError (BrokenPipeError, ...) when the other side is gone."""
        with self._send_lock:
            self.sock.sendall(len(payload).to_bytes(_LENGTH, "little") + payload)

    def receive(self, wait: bool) -> list[Any] | None:
        """The messages that have arrived; None once the peer has gone.

        With ``wait`` it blocks until bytes arrive (if they end mid-frame, that call returns []).
        """
        while not self.closed:
            if messages := self._frames():
                return messages
            if not wait and not self._readable(0.0):
                return []
            try:
                chunk = self.sock.recv(_READ_CHUNK)  # a blocking socket: waits when nothing is there
            except OSError:  # reset by the peer, or the socket closed under us
                chunk = b""
            if not chunk:
                self.closed = True
            self._buffer += chunk
            wait = False  # something arrived: return what is complete without blocking again
        return None

    def _readable(self, timeout: float | None) -> bool:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        return bool(ready)

    def _frames(self) -> list[Any]:
        messages = []
        buffer = self._buffer
        start = 0
        while len(buffer) - start >= _LENGTH:
            size = int.from_bytes(buffer[start : start + _LENGTH], "little")
            end = start + _LENGTH + size
            if len(buffer) < end:
                break
            messages.append(self.decoder.decode(buffer[start + _LENGTH : end]))
            start = end
        del buffer[:start]
        return messages
