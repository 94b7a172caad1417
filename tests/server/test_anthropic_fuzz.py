"""Generated requests against the Messages API: every one gets a 2xx, or a 4xx in Anthropic's error shape, never a
5xx, and the engine's blocks are all back once it is answered. Bodies are drawn from the API's own fields and
content blocks with values of every JSON type, over the tiny random Llama (its core on a thread). Bounded to well
under a minute."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_fuzz_http import json_value, send
from tests.support import wait_until

ROUTES = ["/v1/messages", "/v1/messages/count_tokens"]
FIELDS = [
    "model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "metadata",
    "stream", "tools", "tool_choice", "thinking", "output_config",
]  # fmt: skip
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | json_value}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": st.text(max_size=6), "name": st.text(max_size=6), "input": json_value}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.text(max_size=6) | json_value,
            "content": st.text(max_size=12)
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_value})),
            "is_error": st.booleans(),
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking", "x"])}),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "x"]),
        "content": st.text(max_size=30) | st.lists(block, max_size=3) | json_value,
    }
)
tool = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name"]), "input_schema": json_value | st.just({"type": "object"})},
    optional={"type": st.sampled_from(["custom", "web_search_20250305"]), "description": json_value},
)
tool_choice = st.fixed_dictionaries(
    {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
    optional={"name": st.sampled_from(["f", "g"]), "disable_parallel_tool_use": json_value},
)
field_value = st.one_of(
    json_value,
    st.lists(message, min_size=1, max_size=3),
    st.lists(tool, max_size=2),
    tool_choice,
    st.integers(1, 8),  # short replies, so that some requests run
)
body = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), field_value, max_size=7),
    st.fixed_dictionaries(  # the required fields, so that more bodies get past them
        {"model": st.just("x"), "max_tokens": st.integers(1, 8), "messages": st.lists(message, min_size=1, max_size=3)},
        optional={name: field_value for name in FIELDS if name not in ("model", "max_tokens", "messages")},
    ),
    json_value,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    path=st.sampled_from(ROUTES), payload=st.one_of(body.map(lambda b: json.dumps(b).encode()), st.binary(max_size=40))
)
def test_no_generated_request_gets_a_5xx_or_keeps_blocks(fuzz_server, path: str, payload: bytes) -> None:
    url, engine = fuzz_server
    # The served model's name, where the body names one: more requests reach the engine.
    payload = payload.replace(b'"model": "x"', json.dumps({"model": engine.info.model_name}).encode()[1:-1])
    status, data = send(url, "POST", path, payload)
    assert status < 500, (status, data[:300])
    if status >= 400:
        reply = json.loads(data)
        assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, reply
        assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    wait_until(lambda: engine.stats().running == 0, timeout=30)
    assert engine.stats().blocks_used == 0
