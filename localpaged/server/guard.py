"""The guard in front of every route: the API key, and a cap on the request body's size."""

from __future__ import annotations

import hmac

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

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
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
        if self.key is not None and path not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return APIError(401, "no API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
            if not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
                return APIError(401, "incorrect API key", code="invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return APIError(413, _too_large())
        return None


def _too_large() -> str:
    return f"the request body is over {MAX_BODY_BYTES >> 20} MiB; no prompt that large fits a context"
