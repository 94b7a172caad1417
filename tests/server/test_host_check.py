"""A server without an API key answers loopback Host names only: DNS rebinding cannot reach the model."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from tests.server.running import running_server
from tests.tui.fake_engine import FakeEngine


def get(base_url: str, path: str, host: str, key: str | None = None) -> tuple[int, dict | None]:
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    headers = {"Host": host} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, json.loads(body) if body else None


@pytest.fixture(scope="module")
def keyless() -> str:
    with running_server(FakeEngine()) as url:
        yield url


@pytest.mark.parametrize(
    "host", ["127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "127.1.2.3", "a.localhost"]
)
def test_loopback_names_are_answered(keyless: str, host: str) -> None:
    assert get(keyless, "/v1/models", host)[0] == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "192.168.1.5:8000", "127.0.0.1.evil.example"])
def test_other_names_are_refused_on_every_route(keyless: str, host: str) -> None:
    for path in ("/v1/models", "/health", "/metrics"):
        status, body = get(keyless, path, host)
        assert status == 403 and body["error"]["code"] == "host_not_allowed", (path, body)
        assert "--allowed-hosts" in body["error"]["message"] and "--api-key" in body["error"]["message"]


def test_allowed_hosts_and_an_api_key_open_other_names() -> None:
    engine = FakeEngine()
    with running_server(engine, allowed_hosts=["gpu-box.lan"]) as url:
        assert get(url, "/v1/models", "gpu-box.lan:8000")[0] == 200
        assert get(url, "/v1/models", "evil.example")[0] == 403
    with running_server(engine, api_key="k") as url:  # a key is what guards a server open to the network
        assert get(url, "/v1/models", "gpu-box.lan:8000", key="k")[0] == 200


def test_the_openapi_document_describes_every_route(keyless: str) -> None:
    status, spec = get(keyless, "/openapi.json", "localhost")
    assert status == 200
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}"} <= set(spec["paths"])
    assert "max_tokens" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # what the server sends, and nothing else
