"""The server's socket, made before the model loads: a port in use fails at once, not after the load.

Its own file, free of the web stack's imports, so ``localpaged serve`` starts its engine core without waiting
for them.
"""

from __future__ import annotations

import os
import socket

from localpaged.errors import ConfigError


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (0: any free port), or a ConfigError saying why not.

    The CLI listens before it loads the model, so a port in use fails at once, not after the load.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(f"cannot listen on {host}:{port} ({reason}); pick another --port or --host") from None
