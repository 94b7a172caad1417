"""The guard in front of every route: the Host a keyless server answers, the API key, a cap on the body's size."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from localpaged.server.errors import APIError, error_response

# Open even with an API key: load balancers and Prometheus probe these without one.
OPEN_PATHS = frozenset({"/health", "/metrics"})
MAX_BODY_BYTES = 8 << 20  # far beyond any prompt a context holds; refuses a runaway upload early


class Guard:
    """ASGI middleware in front of every route: the API key, and a cap on the body's size.

    Plain ASGI rather than a BaseHTTPMiddleware, which would stand between a streaming response
    and the client's disconnect.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, allowed_hosts: Iterable[str] = ()) -> None:
        """Without ``api_key`` only loopback Host names (and ``allowed_hosts``) are answered: a web page whose DNS
        name is rebound to 127.0.0.1 would otherwise use the model and read its replies."""
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await error_response(refusal, path=scope["path"])(scope, receive, send)
            return
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise StarletteHTTPException(413, _too_large())
            return message

        await self.app(scope, counted, send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        host = headers.get(b"host")
        if self.key is None and host is not None and not self._answers(host.decode("latin-1")):
            return APIError(
                403,
                f"this server has no API key and answers only loopback Host names, not {host[:100].decode('latin-1')!r}; "
                "start it with --allowed-hosts NAME to answer that name, or with --api-key KEY",
                code="host_not_allowed",
            )
        if self.key is not None and path not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if b"x-api-key" in headers:  # how Anthropic's SDKs send the key
                scheme, token = "bearer", headers[b"x-api-key"].decode("latin-1")
            if scheme.lower() != "bearer" or not token.strip():
                return APIError(
                    401,
                    "no API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                    code="invalid_api_key",
                )
            if not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
                return APIError(401, "incorrect API key", code="invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return APIError(413, _too_large())
        return None

    def _answers(self, host: str) -> bool:
        name = host.strip().lower()
        if name.startswith("["):  # [::1]:8000
            name = name[1 : name.find("]")] if "]" in name else name
        elif name.count(":") == 1:  # a port; a bare IPv6 address has more colons
            name = name.partition(":")[0]
        if name in self.allowed_hosts or name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


def _too_large() -> str:
    return f"the request body is over {MAX_BODY_BYTES >> 20} MiB; no prompt that large fits a context"
