"""`localpaged serve`'s Messages API (/v1/messages) on the tiny random model, driven by the official `anthropic` SDK.

One server for the module (uvicorn on a thread over an AsyncLLM, its core in its own process), with
an API key. Greedy replies must be what ``LLM.chat`` gives for the same conversation; every bad input
is a 400 in Anthropic's error shape.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import anthropic
import jsonschema
import pytest

from localpaged import SamplingParams
from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.output import RequestMetrics, RequestOutput
from localpaged.server.anthropic import stop_reason
from tests.server.running import running_server
from tests.server.test_serve import call

KEY = "sk-ant-test-key"
SYSTEM = "Be brief."
USER = [{"role": "user", "content": "What is a paged KV cache?"}]
CHAT = [{"role": "system", "content": SYSTEM}, *USER]  # the same conversation as the chat template takes it


@pytest.fixture(scope="module")
def base_url(engine: AsyncLLM):
    with running_server(engine, api_key=KEY) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)


def greedy(llm, messages: list[dict], max_tokens: int) -> RequestOutput:
    return llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def post(base_url: str, path: str, body: object = None, *, headers: dict | None = None, raw: bytes | None = None):
    """(status, parsed JSON or text) of a plain POST with Anthropic's headers: for what the SDK would not send."""
    anthropic_headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"} | (headers or {})
    payload = raw if raw is not None else json.dumps(body).encode()
    return call(base_url, path, key=None, raw=payload, headers=anthropic_headers)


def events(text: str) -> list[tuple[str, dict]]:
    """A stream's (event name, data) pairs, in order."""
    pairs = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        pairs.append((lines["event"], json.loads(lines["data"])))
    return pairs


# ----- replies --------------------------------------------------------------------------------------


def test_create_matches_llm_chat(client: anthropic.Anthropic, engine: AsyncLLM, llm) -> None:
    expected = greedy(llm, CHAT, 24)
    reply = client.messages.create(
        model=engine.info.model_name, system=SYSTEM, messages=USER, max_tokens=24, extra_body={"temperature": 0}
    )
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == engine.info.model_name
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == expected.text
    assert reply.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")
    assert reply.stop_sequence is None
    prompt = len(engine.encode_chat(CHAT))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt
    assert reply.usage.output_tokens == len(expected.token_ids)


def test_system_blocks_and_consecutive_turns_read_as_one_text(client: anthropic.Anthropic, engine, llm) -> None:
    """A system prompt of text blocks is their text; two user messages in a row are one turn (as Anthropic joins them)."""
    expected = greedy(llm, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi.\n\nBye."}], 8)
    reply = client.messages.create(
        model=engine.info.model_name,
        system=[
            {"type": "text", "text": "Be "},
            {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[{"role": "user", "content": "Hi."}, {"role": "user", "content": [{"type": "text", "text": "Bye."}]}],
        max_tokens=8,
        extra_body={"temperature": 0},
    )
    assert reply.content[0].text == expected.text


def test_stream_helper_reassembles_the_reply(client: anthropic.Anthropic, engine: AsyncLLM, llm) -> None:
    expected = greedy(llm, CHAT, 24)
    with client.messages.stream(
        model=engine.info.model_name, system=SYSTEM, messages=USER, max_tokens=24, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.text == final.content[0].text
    assert final.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")
    assert final.usage.output_tokens == len(expected.token_ids)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(engine.encode_chat(CHAT))


def test_stream_events_come_in_anthropics_order(base_url: str, engine: AsyncLLM) -> None:
    body = {"model": engine.info.model_name, "messages": USER, "max_tokens": 6, "temperature": 0, "stream": True}
    status, text = post(base_url, "/v1/messages", body)
    assert status == 200
    pairs = events(text)
    names = [name for name, _ in pairs]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta"}
    assert all(data["type"] == name for name, data in pairs)
    start = pairs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert pairs[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(data["delta"]["type"] == "text_delta" for name, data in pairs if name == "content_block_delta")
    assert pairs[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert pairs[-2][1]["usage"]["output_tokens"] >= 1


def test_max_tokens_is_the_stop_reason_at_the_limit(client: anthropic.Anthropic, engine: AsyncLLM, llm) -> None:
    expected = greedy(llm, USER, 3)
    assert expected.finish_reason == "length"  # the tiny model's greedy reply here runs past 3 tokens
    reply = client.messages.create(
        model=engine.info.model_name, messages=USER, max_tokens=3, extra_body={"temperature": 0}
    )
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3
    assert reply.content[0].text == expected.text


def test_a_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic, engine: AsyncLLM, llm) -> None:
    full = greedy(llm, USER, 24).text
    stop = full[6:9]
    assert stop.strip(), full  # a visible stop string from the middle of the reply
    kwargs = {"model": engine.info.model_name, "messages": USER, "max_tokens": 24, "extra_body": {"temperature": 0}}
    reply = client.messages.create(**kwargs, stop_sequences=["never-said-zzz", stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == full[: full.find(stop)]
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        assert "".join(stream.text_stream) == full[: full.find(stop)]
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_stop_reason_says_when_the_context_filled_before_max_tokens() -> None:
    """Agents send max_tokens beyond the context; a reply the context cut short says so."""

    def out(tokens: int, reason: str, text: str = "") -> RequestOutput:
        metrics = RequestMetrics(None, 1000, 0, tokens, None)
        return RequestOutput("r", [1] * 1000, [5] * tokens, text, "", True, reason, metrics)

    assert stop_reason(None, out(24, "length"), [], 1024) == ("model_context_window_exceeded", None)  # type: ignore[arg-type]
    assert stop_reason(None, out(24, "length"), [], 24) == ("max_tokens", None)  # type: ignore[arg-type]
    assert stop_reason(None, out(3, "stop"), [], 24) == ("end_turn", None)  # type: ignore[arg-type]


def test_max_tokens_beyond_the_context_is_served(client: anthropic.Anthropic, engine: AsyncLLM) -> None:
    reply = client.messages.create(
        model=engine.info.model_name, messages=USER, max_tokens=64000, extra_body={"top_k": 1}
    )
    assert reply.stop_reason in ("end_turn", "model_context_window_exceeded")


def test_a_final_assistant_message_is_the_start_of_the_reply(client: anthropic.Anthropic, engine, llm) -> None:
    """Anthropic's prefill: the reply goes on from the final assistant message's text."""
    partial = "A paged KV cache"
    prompt = engine.encode_chat(USER) + engine.tokenizer.encode(partial, add_special_tokens=False)
    expected = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    reply = client.messages.create(
        model=engine.info.model_name,
        messages=[*USER, {"role": "assistant", "content": partial}],
        max_tokens=8,
        extra_body={"temperature": 0},
    )
    assert reply.content[0].text == expected.text
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)


def test_count_tokens_counts_what_create_sends(client: anthropic.Anthropic, engine: AsyncLLM) -> None:
    name = engine.info.model_name
    counted = client.messages.count_tokens(model=name, system=SYSTEM, messages=USER)
    assert counted.input_tokens == len(engine.encode_chat(CHAT))
    reply = client.messages.create(model=name, system=SYSTEM, messages=USER, max_tokens=1)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
    prefilled = [*USER, {"role": "assistant", "content": "A paged"}]
    counted = client.messages.count_tokens(model=name, messages=prefilled)
    assert counted.input_tokens == len(
        engine.encode_chat(USER) + engine.tokenizer.encode("A paged", add_special_tokens=False)
    )


def test_the_prefix_cache_shows_as_cache_read_tokens(client: anthropic.Anthropic, engine: AsyncLLM) -> None:
    system = "You answer questions about operating systems, carefully and in full sentences. " * 8
    kwargs = {"model": engine.info.model_name, "system": system, "messages": USER, "max_tokens": 2}
    client.messages.create(**kwargs)
    again = client.messages.create(**kwargs)
    assert again.usage.cache_read_input_tokens >= 64
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(
        engine.encode_chat([{"role": "system", "content": system}, *USER])
    )


# ----- keys and errors ----------------------------------------------------------------------------------


def test_the_key_comes_as_x_api_key_or_bearer(base_url: str, engine: AsyncLLM) -> None:
    name = engine.info.model_name
    bearer = anthropic.Anthropic(base_url=base_url, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(model=name, messages=USER, max_tokens=1).type == "message"
    wrong = anthropic.Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=name, messages=USER, max_tokens=1)
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "incorrect API key"},
    }
    status, body = post(
        base_url, "/v1/messages", {"model": name, "messages": USER, "max_tokens": 1}, headers={"x-api-key": None}
    )
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "x-api-key" in body["error"]["message"]


def test_any_anthropic_version_is_accepted(base_url: str, engine: AsyncLLM) -> None:
    for version in ("2023-06-01", "2099-01-01", None):
        body = {"model": engine.info.model_name, "messages": USER, "max_tokens": 1}
        status, reply = post(base_url, "/v1/messages", body, headers={"anthropic-version": version})
        assert status == 200 and reply["type"] == "message", reply


GOOD = {"messages": USER, "max_tokens": 2, "temperature": 0}
TOO_LONG = [{"role": "user", "content": "paging " * 1500}]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"messages": []}, "at least one message"),
        ({"messages": [{"role": "system", "content": "x"}]}, "'system'"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "user"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "assistant",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
            "input",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 3}]}]},
            "tool_result",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}],
                    }
                ]
            },
            "image",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "content blocks"),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, "nothing before it"),  # a prefill of nothing
        ({"messages": TOO_LONG}, "1024"),
        ({"messages": TOO_LONG, "stream": True}, "1024"),
        ({"system": 7}, "system"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "input_schema"),
        ({"tools": [{"name": "web_search", "type": "web_search_20250305", "input_schema": {}}]}, "server tools"),
        ({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tool name"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}] * 2}, "two tools"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}] * 129}, "tools"),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "g"},
            },
            "'g'",
        ),
        ({"tool_choice": {"type": "any"}}, "send the tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "output_config": {"format": {"type": "json_schema", "schema": {}}},
            },
            "output_config.format",
        ),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "messages": [*USER, {"role": "assistant", "content": "I"}],
            },
            "prefill",
        ),
        ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_a_bad_input_is_a_400_in_anthropics_shape(base_url: str, engine, change: dict, words: str) -> None:
    body = {"model": engine.info.model_name, **GOOD, **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, reply = post(base_url, "/v1/messages", body)
    assert status == 400, reply
    assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}
    assert reply["error"]["type"] == "invalid_request_error"
    assert words in reply["error"]["message"], reply
    status, reply = post(base_url, "/v1/messages", {"model": engine.info.model_name, **GOOD})
    assert status == 200 and reply["type"] == "message"  # the server goes on


def test_the_sdk_reads_the_errors(client: anthropic.Anthropic, engine: AsyncLLM) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=engine.info.model_name, messages=USER, max_tokens=2, extra_body={"top_p": 5})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "top_p" in caught.value.message
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-not-here", messages=USER, max_tokens=2)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert engine.info.model_name in caught.value.body["error"]["message"]  # says which model is served
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=engine.info.model_name, messages=[])


def test_malformed_bodies_and_unknown_paths_answer_in_anthropics_shape(base_url: str) -> None:
    status, reply = post(base_url, "/v1/messages", raw=b"{not json")
    assert status == 400 and reply["error"]["type"] == "invalid_request_error" and "JSON" in reply["error"]["message"]
    status, reply = post(base_url, "/v1/messages", raw=b"[1, 2]")
    assert status == 400 and reply["type"] == "error"
    status, reply = post(base_url, "/v1/messages/batches", {})
    assert status == 404 and reply["error"]["type"] == "not_found_error"
    # A body announced over the cap is refused from its headers, before any of it is sent.
    conn = http.client.HTTPConnection(urlsplit(base_url).hostname, urlsplit(base_url).port, timeout=60)
    conn.putrequest("POST", "/v1/messages")
    for name, value in (("Content-Type", "application/json"), ("Content-Length", str(9 << 20)), ("x-api-key", KEY)):
        conn.putheader(name, value)
    conn.endheaders()
    response = conn.getresponse()
    reply = json.loads(response.read())
    conn.close()
    assert response.status == 413 and reply["error"]["type"] == "request_too_large", reply


# ----- constrained replies on the tiny model ------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_required_tool_call_is_a_tool_use_block_of_its_schema(
    client: anthropic.Anthropic, engine, tool_choice
) -> None:
    """The grammar holds even a random model to a call of the tool, its input valid for the tool's schema."""
    kwargs = {"model": engine.info.model_name, "messages": USER, "max_tokens": 200, "tools": [WEATHER]}
    reply = client.messages.create(**kwargs, tool_choice=tool_choice, extra_body={"temperature": 0})
    assert reply.stop_reason == "tool_use", reply
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, CITY)
    with client.messages.stream(**kwargs, tool_choice=tool_choice, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(call.name, call.input)]


def test_output_config_format_holds_the_reply_to_its_schema(client: anthropic.Anthropic, engine: AsyncLLM) -> None:
    reply = client.messages.create(
        model=engine.info.model_name,
        messages=USER,
        max_tokens=200,
        output_config={"format": {"type": "json_schema", "schema": CITY}},
        extra_body={"temperature": 0},
    )
    assert reply.stop_reason == "end_turn", reply
    jsonschema.validate(json.loads(reply.content[0].text), CITY)


@pytest.mark.parametrize("max_tokens", [6, 14])
def test_a_call_cut_off_by_max_tokens_still_answers(client: anthropic.Anthropic, engine, max_tokens: int) -> None:
    """Half a call is no call: the reply says max_tokens (ReplyBlocks' own test pins its blocks)."""
    kwargs = {"model": engine.info.model_name, "messages": USER, "max_tokens": max_tokens, "tools": [WEATHER]}
    reply = client.messages.create(**kwargs, tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == max_tokens
    assert {b.type for b in reply.content} <= {"text", "tool_use"}
