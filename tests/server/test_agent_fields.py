"""What agents send, over HTTP with real clients: tools (and the legacy functions), structured replies,
logprobs, n, penalties and logit_bias, on the tiny random model (the default model's tokenizer and
template, so the generic tool format), and every new refusal as a 400 naming its field.

Replies are checked by the openai client's own types (it parses every body and chunk) and by what the
request asked for: a constrained call is valid JSON of its tool's schema, a streamed reply reassembles
into the non-streamed one, greedy logprobs pick their top token.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.remote import RemoteEngine
from localpaged.errors import RequestError
from localpaged.sampling import SamplingParams, StructuredOutputs
from tests.server.running import running_server
from tests.server.test_serve import call as http_call

USER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
# Bounded values only (enums, booleans): the random model's greedy strings would run to max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


_SERVED: list[str] = []


def served() -> str:
    """The model the module's server serves (the tiny model's folder name)."""
    return _SERVED[-1]


@pytest.fixture(scope="module")
def base_url(engine: AsyncLLM):
    _SERVED.append(engine.info.model_name)
    with running_server(engine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


def arguments_of(call_json: str) -> dict:
    args = json.loads(call_json)
    assert isinstance(args, dict)
    return args


def check_weather(args: dict) -> None:
    assert set(args) == {"city", "celsius"} and args["city"] in ("Paris", "Rome") and isinstance(args["celsius"], bool)


def reassemble(chunks) -> tuple[str, list[dict], list[str | None]]:
    """(content, tool calls, finish reasons) of one choice's stream, as a client puts OpenAI's deltas together."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
            reasons.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], [r for r in reasons if r]


# ----- tools --------------------------------------------------------------------------------------


def test_a_required_tool_call_is_valid_json_of_its_schema_streamed_or_not(client: openai.OpenAI) -> None:
    common = {"model": served(), "messages": USER, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    reply = client.chat.completions.create(**common, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in ("get_weather", "get_time")
        args = arguments_of(call.function.arguments)
        if call.function.name == "get_weather":
            check_weather(args)
    content, calls, reasons = reassemble(client.chat.completions.create(**common, max_tokens=200, stream=True))
    assert reasons == ["tool_calls"] and content == ""
    expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert all(c["id"].startswith("call_") for c in calls)


def test_a_named_tool_is_the_one_called(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=served(), messages=USER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=100
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    check_weather(arguments_of(call.function.arguments))
    chunks = list(
        client.chat.completions.create(
            model=served(), messages=USER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=100, stream=True
        )
    )
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert pieces[0].function.name == "get_weather" and pieces[0].id == pieces[0].id.strip()
    assert len(pieces) > 2 and all(p.function.name is None for p in pieces[1:])  # name first, then arguments
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_auto_with_the_generic_format_is_a_call_or_an_answer(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=served(), messages=USER, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=120
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                arguments_of(call.function.arguments)
        elif choice.finish_reason == "stop":
            assert isinstance(choice.message.content, str)


def test_tool_choice_none_answers_in_text(client: openai.OpenAI, engine: AsyncLLM) -> None:
    plain = client.chat.completions.create(model=served(), messages=USER, temperature=0, max_tokens=12)
    none = client.chat.completions.create(
        model=served(), messages=USER, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12
    )
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


def test_tool_turns_in_the_history_are_taken(client: openai.OpenAI) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    reply = client.chat.completions.create(model=served(), messages=history, tools=TOOLS, temperature=0, max_tokens=20)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    without_tools = client.chat.completions.create(model=served(), messages=history, temperature=0, max_tokens=5)
    assert without_tools.choices[0].message.role == "assistant"


def test_legacy_functions_are_answered_with_function_call(base_url: str) -> None:
    body = {
        "messages": USER,
        "functions": [WEATHER["function"]],
        "function_call": {"name": "get_weather"},
        "temperature": 0,
        "max_tokens": 100,
    }
    status, reply = http_call(base_url, "/v1/chat/completions", body, key=None)
    assert status == 200, reply
    ChatCompletion.model_validate(reply)
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "function_call"
    assert message["function_call"]["name"] == "get_weather" and "tool_calls" not in message
    check_weather(arguments_of(message["function_call"]["arguments"]))


# ----- structured replies -------------------------------------------------------------------------


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completions = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    reply = completions(model=served(), messages=USER, response_format=Forecast, temperature=0, max_tokens=60)
    assert isinstance(reply.choices[0].message.parsed, Forecast)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda text: len(text) == 3 and text.isdigit()),
        ({"guided_regex": "(ab)+c"}, lambda text: text.startswith("ab") and text.endswith("c")),
        ({"guided_json": Forecast.model_json_schema()}, lambda text: Forecast.model_validate_json(text)),
    ],
)
def test_vllms_structured_fields_hold_the_reply(client: openai.OpenAI, extra: dict, check) -> None:
    reply = client.chat.completions.create(
        model=served(), messages=USER, temperature=0, max_tokens=60, extra_body=extra
    )
    assert check(reply.choices[0].message.content), reply.choices[0].message.content
    text = client.completions.create(model=served(), prompt="Answer:", temperature=0, max_tokens=60, extra_body=extra)
    assert check(text.choices[0].text), text.choices[0].text


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_extracts_a_pydantic_model(base_url: str, mode: str) -> None:
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0), mode=getattr(instructor.Mode, mode)
    )
    forecast = client.chat.completions.create(
        model=served(), messages=USER, response_model=Forecast, temperature=0, max_tokens=60, max_retries=0
    )
    assert isinstance(forecast, Forecast)


# ----- logprobs, n, sampling fields ----------------------------------------------------------------


def test_chat_logprobs_have_openais_shape_and_pick_the_top_token(client: openai.OpenAI) -> None:
    common = {
        "model": served(),
        "messages": USER,
        "temperature": 0,
        "max_tokens": 8,
        "extra_body": {"ignore_eos": True},
    }
    reply = client.chat.completions.create(**common, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    items = choice.logprobs.content
    assert len(items) == reply.usage.completion_tokens == 8
    for item in items:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
    assert b"".join(bytes(item.bytes) for item in items).decode() == choice.message.content
    streamed = [
        item
        for chunk in client.chat.completions.create(**common, logprobs=True, top_logprobs=3, stream=True)
        for c in chunk.choices
        if c.logprobs is not None
        for item in c.logprobs.content
    ]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in items]
    assert client.chat.completions.create(**common).choices[0].logprobs is None


def test_completion_logprobs_have_openais_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=served(), prompt="The sky is", temperature=0, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text and len(lp.token_logprobs) == 6
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(p) for top, p in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_n_choices_streamed_and_whole(client: openai.OpenAI) -> None:
    common = {"model": served(), "messages": USER, "temperature": 1.0, "seed": 7, "max_tokens": 6, "n": 3}
    reply = client.chat.completions.create(**common, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 18
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 18
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in reply.choices]
    text = client.completions.create(model=served(), prompt="Hi", n=2, max_tokens=3, temperature=1.0, seed=1)
    assert sorted(c.index for c in text.choices) == [0, 1]


def test_logit_bias_with_string_ids_and_the_penalties_are_applied(client: openai.OpenAI, engine: AsyncLLM) -> None:
    token = 1000
    reply = client.chat.completions.create(
        model=served(), messages=USER, temperature=0, max_tokens=4, logit_bias={str(token): 100}, logprobs=True
    )
    assert [engine.tokenizer.convert_tokens_to_ids(engine.tokenizer.convert_ids_to_tokens(token))] == [token]
    assert reply.usage.completion_tokens == 4
    assert all(item.token == engine.tokenizer.decode([token]) for item in reply.choices[0].logprobs.content)
    penalized = client.chat.completions.create(
        model=served(),
        messages=USER,
        temperature=0,
        max_tokens=8,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.1},
    )
    assert penalized.choices[0].finish_reason in ("stop", "length")


# ----- refusals -----------------------------------------------------------------------------------

GOOD = {"messages": USER, "max_tokens": 2, "temperature": 0}
TOOL_TURN = {"role": "tool", "content": "18 C"}
BAD_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "functions": [WEATHER["function"]]}, "functions"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [*USER, TOOL_TURN]}, "messages[1]"),  # no tool_call_id
        (
            {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [BAD_CALL]}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [BAD_CALL]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"ebnf": "root ::= 'a'"}}, "structured_outputs.ebnf"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),  # refused by xgrammar, blamed on the field
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
        ({"logprobs": 3}, "logprobs"),  # chat takes a boolean
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # past the vocabulary
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
    ],
)
def test_a_bad_agent_field_is_a_400_naming_it(base_url: str, change: dict, param: str) -> None:
    status, body = http_call(base_url, "/v1/chat/completions", {**GOOD, **change}, key=None)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
    ],
)
def test_a_bad_completion_field_is_a_400_naming_it(base_url: str, change: dict, param: str) -> None:
    status, body = http_call(base_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **change}, key=None)
    assert status == 400 and body["error"]["param"] == param, body


# ----- RemoteEngine: the same fields over the wire ---------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, temperature=0, logit_bias={1000: 100}),
        SamplingParams(
            max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.2
        ),
        SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutputs(choice=["yes", "no"])),
        SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutputs(regex="[0-9]{3}")),
        SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutputs(json=Forecast.model_json_schema())),
        SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutputs(json_object=True)),
    ],
    ids=["logit_bias", "penalties", "choice", "regex", "json", "json_object"],
)
def test_a_remote_engine_sends_the_fields_and_gets_the_local_reply(
    base_url: str, engine: AsyncLLM, params: SamplingParams
) -> None:
    remote = RemoteEngine(base_url)
    try:
        far = list(remote.iter_stream(USER, params))[-1]
    finally:
        remote.shutdown()
    near = list(engine.iter_stream(USER, params))[-1]
    assert far.text == near.text and far.finish_reason == near.finish_reason


def test_a_remote_engine_refuses_logprobs_it_cannot_give(base_url: str) -> None:
    remote = RemoteEngine(base_url)
    try:
        with pytest.raises(RequestError, match="logprobs: a remote engine"):
            list(remote.iter_stream(USER, SamplingParams(logprobs=2)))
    finally:
        remote.shutdown()
