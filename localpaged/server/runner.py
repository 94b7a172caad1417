"""Running the app under uvicorn: listening, and stopping the way ``localpaged serve`` promises.

Ctrl-C or SIGTERM stops accepting connections, aborts every request in flight (their clients get
an error event, their KV blocks go back) and returns, so the command exits 0 within a second or
two, instead of uvicorn's default of waiting for every open stream to finish on its own. A second
signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from localpaged.server.state import ServerState

GRACE_S = 3.0  # after the aborts, how long uvicorn waits for responses to end before it cancels them


class Server(uvicorn.Server):
    """uvicorn's server over one of our apps; ``stop()`` (or SIGINT/SIGTERM) aborts what is in flight and ends."""

    def __init__(self, app: FastAPI, *, log_level: str = "warning") -> None:
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=GRACE_S
        )
        super().__init__(config)
        self.state: ServerState = app.state.localpaged
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def stop(self) -> None:
        """Ask the server to end; safe from any thread and from a signal handler."""
        self.should_exit = True
        self.state.stopping = True
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing is in flight
                self._loop.call_soon_threadsafe(self._abort_all)

    def _abort_all(self) -> None:
        task = asyncio.ensure_future(self.state.abort_all())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Our handlers for SIGINT and SIGTERM while serving; unlike uvicorn's, they are not re-raised after.

        A stop on request is the normal end of a server, so the command exits 0.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for anything
        self.stop()


def serve(app: FastAPI, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Serve ``app`` on the listening ``sock`` until SIGINT/SIGTERM (see the module docstring)."""
    Server(app, log_level=log_level).run(sockets=[sock])
