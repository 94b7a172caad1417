"""Where AsyncLLM's engine core runs: its own process (the default), or a thread of this one.

Both carry the same encoded messages (localpaged.engine.messages) and call the same two hooks of
the front end: ``dispatch(payload)`` for each message from the core, ``on_exit()`` once the core
has stopped for whatever reason. Only the transport and the place of the loop differ.
"""

from __future__ import annotations

import collections
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from localpaged.engine import messages as m
from localpaged.engine.core import EngineCore
from localpaged.errors import EngineDeadError
from localpaged.models import Progress

Dispatch = Callable[[Any], None]  # takes one decoded message from the core

# How long shutdown() waits for the core to finish its step and exit before killing it.
SHUTDOWN_WAIT_S = 10.0
# Lines of the core's stderr kept to explain a death (a native crash, an allocation failure).
STDERR_TAIL = 20


class CoreThread:
    """``engine_process=False``: the core loop on a daemon thread, commands through an in-memory inbox."""

    def __init__(self, llm: Any, dispatch: Dispatch, on_exit: Callable[[], None]) -> None:
        self._inbox: list[bytes] = []
        self._closed = False
        self._wakeup = threading.Condition()
        self._core = EngineCore(llm, lambda payload: dispatch(m.from_core.decode(payload)))
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._serve, name="localpaged-engine", daemon=True)
        self._thread.start()

    def send(self, payload: bytes) -> None:
        with self._wakeup:
            if self._closed:
                raise BrokenPipeError("the engine thread has stopped")
            self._inbox.append(payload)
            self._wakeup.notify()

    def _receive(self, wait: bool) -> list[Any] | None:
        with self._wakeup:
            while wait and not self._inbox and not self._closed:
                self._wakeup.wait()
            if self._closed and not self._inbox:
                return None
            payloads, self._inbox = self._inbox, []
        return [m.to_core.decode(p) for p in payloads]

    def _serve(self) -> None:
        try:
            self._core.run(self._receive)
        finally:
            with self._wakeup:
                self._closed = True
            self._on_exit()

    def shutdown(self) -> None:
        try:
            self.send(m.encode(m.Shutdown()))
        except BrokenPipeError:
            return
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=SHUTDOWN_WAIT_S)

    def exit_cause(self) -> str:
        return "the engine thread stopped"


class CoreProcess:
    """The core in a child process, started with plain values only, talking over a socketpair.

    The constructor returns once the engine is built (relaying start-up progress meanwhile) and raises
    the core's own error (a bad model path stays a ModelNotFoundError) if it could not be built.
    """

    def __init__(
        self, engine_config: dict[str, Any], progress: Progress | None, on_resolved: Callable[[str], None]
    ) -> None:
        """``on_resolved(model_folder)`` is called as soon as the core knows the model's folder."""
        ours, theirs = socket.socketpair()
        # -P: the working folder is not put first on sys.path, so a folder named localpaged there (a checkout,
        # anything a user runs from) is never imported in place of the installed package.
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "localpaged.engine.core", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the terminal's Ctrl-C and hang-up go to the front end, which ends the core
        )
        theirs.close()
        self.channel = m.Channel(ours, m.from_core)
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        threading.Thread(target=self._relay_stderr, name="localpaged-core-stderr", daemon=True).start()
        try:
            self.channel.send(m.encode(m.Start(engine_config)))
            self.ready = self._wait_until_ready(progress or (lambda message, fraction: None), on_resolved)
        except BaseException:
            self.kill()
            raise

    def _wait_until_ready(self, progress: Progress, on_resolved: Callable[[str], None]) -> m.Ready:
        while (received := self.channel.receive(wait=True)) is not None:
            for message in received:
                if isinstance(message, m.Progress):
                    progress(message.message, message.fraction)
                elif isinstance(message, m.Resolved):
                    on_resolved(message.model_folder)
                elif isinstance(message, m.Ready):
                    return message
                elif isinstance(message, m.StartFailed):
                    self.process.wait(timeout=SHUTDOWN_WAIT_S)
                    raise m.error_from(message.error_type, message.message)
        raise EngineDeadError(f"the engine core process died while starting ({self.exit_cause()})")

    def serve(self, dispatch: Dispatch, on_exit: Callable[[], None]) -> None:
        """Hand every message from the core to ``dispatch`` on a reader thread; ``on_exit`` at its end."""

        def read() -> None:
            try:
                while (received := self.channel.receive(wait=True)) is not None:
                    for message in received:
                        dispatch(message)
            finally:
                on_exit()

        threading.Thread(target=read, name="localpaged-core-reader", daemon=True).start()

    def send(self, payload: bytes) -> None:
        self.channel.send(payload)

    def shutdown(self) -> None:
        """Ask the core to stop after its step; kill it if it does not exit in time."""
        try:
            self.channel.send(m.encode(m.Shutdown()))
            self.process.wait(timeout=SHUTDOWN_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def exit_cause(self) -> str:
        """How the core ended, in words: its exit code or signal, and the last thing it printed."""
        try:
            code = self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        if code < 0:
            try:
                cause = f"killed by signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                cause = f"killed by signal {-code}"
            if -code == signal.SIGKILL:
                cause += ", perhaps by the system for lack of memory"
        else:
            cause = f"exit code {code}"
        tail = [line for line in self._stderr_tail if line.strip()]
        return f"{cause}; its last words: {tail[-1].strip()}" if tail else cause

    def _relay_stderr(self) -> None:
        """The core's warnings reach this process's stderr (the TUI captures it) and the death message."""
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode("utf-8", "replace")
            self._stderr_tail.append(line)
            sys.stderr.write(line)
