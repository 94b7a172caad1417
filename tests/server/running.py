"""Our server on a free loopback port, on a thread of the test process: for the tests that talk to one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from localpaged.engine.protocol import EngineClient
from localpaged.server.app import build_app
from localpaged.server.listen import listen
from localpaged.server.runner import Server
from tests.support import wait_until

# The tiny model's engine settings for a server test: small, exact, on the CPU.
TINY = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "64MiB", "max_model_len": 1024}


@contextmanager
def running_server(
    engine: EngineClient, api_key: str | None = None, allowed_hosts: tuple[str, ...] | list[str] = ()
) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server over ``engine`` for the length of the ``with`` block."""
    sock = listen("127.0.0.1", 0)
    server = Server(build_app(engine, api_key=api_key, allowed_hosts=allowed_hosts))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=30)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.stop()
        thread.join(timeout=10)
        sock.close()
