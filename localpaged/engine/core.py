"""The engine core: steps an LLM and nothing else, in its own process (or on a thread, for tests).

Why a process: stepped on a second thread of the UI's process, the engine ran at a fraction of its
speed in the app (benchmarks/app_speed.py measures both), since every one of the hundreds of native
calls of a step gave the GIL back and waited for it again while the UI thread held it, and two OpenMP
thread teams fought over the cores. In its own process the core owns its GIL and its thread team.

Threads: torch's default of one thread a core with OpenMP's default waiting was the fastest, alone and
beside a UI-like thread, against one thread and against OMP_WAIT_POLICY=PASSIVE (benchmarks/app_speed.py,
run with those variables in its environment, compares them). So the core keeps the defaults: a front
end that mostly waits on a socket costs it nothing.

The loop: take the commands that have arrived (waiting only while nothing runs), then run one
step and send one message with every request's new tokens. Calls (stats, kv_map) are answered
between steps, so they see a consistent engine. The core exits when the front end goes: on the
channel's end of file, and, during a long step, when its parent process is gone.

Run as ``python -m localpaged.engine.core FD`` with FD one end of a socketpair; the first message
on it names the EngineConfig fields. Nothing is pickled and nothing but plain values is passed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from localpaged import errors
from localpaged.engine import messages as m
from localpaged.engine.output import RequestOutput

log = logging.getLogger(__name__)

# Every request-independent call the front end may make, and nothing else (prefetch: reads a prompt's
# blocks from the disk tier). Encoding is the front end's: the core is sent token ids.
CALLS = ("stats", "kv_map", "prefetch")
# How often the core checks, during a long step, that its front end still exists.
PARENT_CHECK_S = 0.5

Receive = Callable[[bool], "list[Any] | None"]  # wait? -> commands, or None when the front end is gone
Emit = Callable[[bytes], None]


class EngineCore:
    """Commands in, one message per step out. ``llm`` is an LLM or anything of its shape (tests use fakes)."""

    def __init__(self, llm: Any, emit: Emit) -> None:
        self.llm = llm
        self.emit = emit
        # request id -> its unfinished samples' generated token ids already sent, by sample index
        self._sent: dict[str, dict[int, int]] = {}

    def run(self, receive: Receive) -> None:
        """Serve until Shutdown or until the front end is gone."""
        while (commands := receive(not self.llm.has_unfinished_requests())) is not None:
            for command in commands:
                if isinstance(command, m.Shutdown):
                    return
                self.handle(command)
            if self.llm.has_unfinished_requests():
                self.step()

    def handle(self, command: m.Add | m.Abort | m.Call) -> None:
        if isinstance(command, m.Add):
            self._add(command)
        elif isinstance(command, m.Abort):
            self._abort(command.request_id)
        elif isinstance(command, m.Call):
            self._call(command)

    def _add(self, add: m.Add) -> None:
        from localpaged.sampling import SamplingParams

        try:
            params = SamplingParams(**add.params) if add.params is not None else None
            self.llm.add_request(add.prompt, params, add.request_id)
        except Exception as exc:  # noqa: BLE001 -- bad input concerns this request only
            self._emit(m.RequestFailed(add.request_id, type(exc).__name__, str(exc)))
            return
        self._sent[add.request_id] = dict.fromkeys(range(params.n if params is not None else 1), 0)

    def _abort(self, request_id: str) -> None:
        if self._sent.pop(request_id, None) is None:
            return  # finished in a step the front end has not read yet; its final output is on the way
        try:
            self.llm.abort(request_id)
        except Exception:
            log.debug("abort of %s did not succeed", request_id, exc_info=True)
        self._emit(m.Aborted(request_id))

    def _call(self, call: m.Call) -> None:
        if call.method not in CALLS:
            self._emit(m.Reply(call.call_id, error=f"unknown engine call {call.method!r}"))
            return
        try:
            value = getattr(self.llm, call.method)(*call.args)
        except Exception as exc:  # noqa: BLE001 -- the caller gets the error, the engine goes on
            self._emit(m.Reply(call.call_id, error=f"{type(exc).__name__}: {exc}"))
            return
        self._emit(m.Reply(call.call_id, value=value))

    def step(self) -> None:
        """One engine step; its outputs leave in one message."""
        try:
            outputs = self.llm.step()
        except Exception as exc:
            log.exception("engine step failed; failing every request in flight")
            self._fail_all(exc)
            return
        wire = [self._wire(out) for out in outputs if out.request_id in self._sent]
        if wire:
            self._emit(m.StepOutputs(wire))

    def _wire(self, out: RequestOutput) -> m.Output:
        samples = self._sent[out.request_id]
        sent = samples[out.index]
        if not out.finished:
            samples[out.index] = len(out.token_ids)
        elif len(samples) > 1:
            del samples[out.index]
        else:
            del self._sent[out.request_id]
        return m.Output(
            request_id=out.request_id,
            new_token_ids=out.token_ids[sent:],
            delta=out.delta,
            finished=out.finished,
            finish_reason=out.finish_reason,
            metrics=out.metrics,
            prompt_token_ids=out.prompt_token_ids if sent == 0 else None,
            error=out.error,
            new_logprobs=out.logprobs[sent:] if out.logprobs is not None else None,
            index=out.index,
        )

    def _fail_all(self, cause: Exception) -> None:
        message = (
            f"the engine failed while serving this request ({type(cause).__name__}: {cause}); "
            "the request was stopped, new requests are still served"
        )
        for request_id in list(self._sent):
            del self._sent[request_id]
            try:
                self.llm.abort(request_id)
            except Exception:
                log.debug("abort of %s after a failed step did not succeed", request_id, exc_info=True)
            self._emit(m.RequestFailed(request_id, "LocalpagedError", message))

    def _emit(self, message: m.StepOutputs | m.Aborted | m.RequestFailed | m.Reply) -> None:
        self.emit(m.encode(message))


# ----- the process --------------------------------------------------------------------------


def _exit_when_orphaned(parent: int) -> None:
    """Exit when the front end is gone, even in the middle of a long step (EOF is seen only between steps)."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(0)


def serve(fd: int) -> int:
    """The core process: build the engine named by the first message, then serve until the front end goes."""
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="parent-watch", daemon=True).start()
    channel = m.Channel(socket.socket(fileno=fd), m.to_core)
    first = channel.receive(wait=True)
    if not first or not isinstance(first[0], m.Start):
        return 1

    def progress(message: str, fraction: float | None) -> None:
        channel.send(m.encode(m.Progress(message, fraction)))

    from localpaged.models.loader import resolve_model

    try:
        files = resolve_model(first[0].config.get("model"), progress)  # reads a GGUF's metadata on its first use
        channel.send(m.encode(m.Resolved(str(files.folder))))
        # torch only now: the front end loads its tokenizer from the folder just sent while this imports.
        from localpaged.engine.llm import LLM

        llm = LLM(progress=progress, model_files=files, **first[0].config)
    except errors.LocalpagedError as exc:
        channel.send(m.encode(m.StartFailed(type(exc).__name__, str(exc))))
        return 1
    except Exception as exc:
        log.exception("the engine could not start")
        channel.send(
            m.encode(m.StartFailed("LocalpagedError", f"the engine could not start: {type(exc).__name__}: {exc}"))
        )
        return 1
    channel.send(m.encode(m.Ready(llm.model_name, str(llm.model_folder), llm.resolved, llm.engine_tokenizer.probe_ids)))
    try:
        EngineCore(llm, channel.send).run(channel.receive)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the front end went away mid-send: nothing is left to serve
    finally:
        llm.close()  # the disk tier's last blocks, before os._exit skips every thread
    return 0


def main(argv: list[str]) -> int:
    # Ctrl-C in the terminal is for the front end, which shuts the core down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="localpaged core: %(levelname)s %(message)s")
    return serve(int(argv[1]))


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    # Skip tearing the interpreter down: with torch loaded that is slow, every shutdown() waited for it,
    # and the core has nothing left to write.
    os._exit(code)
