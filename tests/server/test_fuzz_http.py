"""Generated requests against the HTTP server: every one gets a 2xx, or a 4xx in OpenAI's error shape, never a 5xx,
and the engine's blocks are all back once it is answered. The server runs over a real engine (the tiny random
Llama, its core on a thread); bodies are drawn from the routes' own fields with values of every JSON type, and
some are not JSON at all. Bounded to well under a minute."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import wait_until

ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/v1/models/x"]
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "n", "stream", "stream_options", "ignore_eos", "logprobs", "tools", "tool_choice",
    "functions", "response_format", "continue_final_message", "add_generation_prompt", "tokens", "echo",
]  # fmt: skip
json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=12)
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
        "content": json_value | st.text(max_size=30),
    }
)
field_value = st.one_of(
    json_value,
    st.lists(message, max_size=3),
    st.integers(1, 8),  # short replies, so that some requests run
    st.lists(st.integers(-2, 70000), max_size=8),
)
body = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), field_value, max_size=6),
    json_value,
)


def send(url: str, method: str, path: str, payload: bytes | None) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]),
    path=st.sampled_from(ROUTES),
    payload=st.one_of(body.map(lambda b: json.dumps(b).encode()), st.binary(max_size=40)),
)
def test_no_generated_request_gets_a_5xx_or_keeps_blocks(fuzz_server, method: str, path: str, payload: bytes) -> None:
    url, engine = fuzz_server
    status, data = send(url, method, path, payload if method in ("POST", "PUT") else None)
    assert status < 500, (status, data[:300])
    if status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["message"] and "type" in error
    wait_until(lambda: engine.stats().running == 0, timeout=30)
    assert engine.stats().blocks_used == 0
