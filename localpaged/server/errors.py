"""Errors as OpenAI's API returns them: a status and ``{"error": {message, type, param, code}}``;
and as Anthropic's Messages API does (``/v1/messages``): ``{"type": "error", "error": {type, message}}``.

Clients written for OpenAI (its own SDK among them) read ``error.message`` and ``param``; a
FastAPI ``{"detail": ...}`` or a 422 would reach them as an unexplained failure.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from localpaged.errors import LocalpagedError

_json = msgspec.json.Encoder()
# Anthropic's error type for each status (its API's "Errors" page); other 4xx are invalid_request_error.
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"  # the paths whose errors take Anthropic's shape


class APIError(LocalpagedError):
    """A request refused with an HTTP status and OpenAI's error body: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The same error as Anthropic's API words it: its type follows the status."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def json_response(body: dict, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def error_response(error: APIError, headers: Mapping[str, str] | None = None, *, path: str = "") -> Response:
    """OpenAI's error body (Anthropic's for a ``path`` under /v1/messages); ``headers`` the ones the status
    needs (``Allow`` on a 405, RFC 9110)."""
    body = error.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else error.body()
    response = json_response(body, error.status)
    response.headers.update(headers or {})
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's first complaint as OpenAI's 400: which field (``param``), what is wrong, what was sent."""
    first = exc.errors()[0]
    kind, message = first.get("type", ""), str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None)
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return bad_request(f"the request body must be a JSON object with the request's fields ({message})", None)
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    sent = first.get("input")
    if kind not in ("missing", "value_error") and isinstance(sent, (str, int, float, bool, type(None))):
        shown = repr(sent) if len(repr(sent)) <= 60 else repr(sent)[:57] + "..."
        message = f"{message}, not {shown}"
    return bad_request(f"{param}: {message}", param)
