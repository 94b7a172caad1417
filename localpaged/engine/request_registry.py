"""The requests a front end has in flight, by id: what AsyncLLM and RemoteEngine both keep.

An id is taken by one request at a time, a request without one gets a fresh id, an abort of an id that is
not in flight says so, and once the engine is closed nothing more is taken (the closing error is raised).
Thread-safe: streams open on the caller's thread and end on the engine's.
"""

from __future__ import annotations

import threading
import uuid
from typing import Generic, Protocol, TypeVar

from localpaged.errors import LocalpagedError, RequestError


class Request(Protocol):
    request_id: str


R = TypeVar("R", bound=Request)


def new_request_id(request_id: str | None = None) -> str:
    """``request_id`` where the caller chose one, else a fresh one."""
    return request_id or f"req-{uuid.uuid4().hex[:16]}"


class RequestRegistry(Generic[R]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, R] = {}
        self._closed: LocalpagedError | None = None

    def add(self, request: R) -> None:
        """Take ``request`` under its id; a RequestError if the id is in flight, the closing error once closed."""
        with self._lock:
            if self._closed is not None:
                raise self._closed
            if request.request_id in self._requests:
                raise RequestError(f"request id {request.request_id!r} is already in flight; use another id")
            self._requests[request.request_id] = request

    def get(self, request_id: str) -> R | None:
        with self._lock:
            return self._requests.get(request_id)

    def in_flight(self, request_id: str) -> R:
        """The request ``request_id`` names, for an abort: a RequestError where none is in flight."""
        request = self.get(request_id)
        if request is None:
            raise RequestError(f"no request {request_id!r} is in flight (unknown id, or already finished)")
        return request

    def pop(self, request_id: str) -> R | None:
        with self._lock:
            return self._requests.pop(request_id, None)

    def discard(self, request: R) -> None:
        """Forget ``request``, unless its id now belongs to another."""
        with self._lock:
            if self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def values(self) -> list[R]:
        with self._lock:
            return list(self._requests.values())

    def close(self, error: LocalpagedError) -> list[R]:
        """Take no more requests (``add`` raises ``error``); returns those still in flight, forgotten here."""
        with self._lock:
            self._closed = error
            requests, self._requests = list(self._requests.values()), {}
        return requests
