"""Tool use through /v1/messages with the official `anthropic` SDK, over a scripted engine (FakeLLM).

The scripted reply is what a model writes in the generic tool format (the default model's: its
template has no tool format of its own), so these tests pin the mapping itself: Anthropic's tools,
tool_choice and tool turns into the tool layer's prompt and grammar, and the reply back into
``tool_use`` blocks, whole and streamed. The grammar's effect on a real model is the structured
branch's to test (tests/server/test_anthropic.py runs tools on the tiny model when it is there).
"""

from __future__ import annotations

import json

import anthropic
import pytest

from localpaged.chat.tool_calls import ToolPlan, constraint
from localpaged.engine.async_llm import AsyncLLM
from localpaged.sampling import SamplingParams
from localpaged.server.anthropic_tools import ReplyBlocks
from tests.engine.fake_llm import FakeLLM
from tests.server.running import running_server

KEY = "sk-ant-tools"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_FUNCTION = {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
TWO_CALLS = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]}'


class ScriptedLLM(FakeLLM):
    """Replies ``script``, and keeps each request's prompt text and SamplingParams."""

    def __init__(self) -> None:
        super().__init__(lambda ids: self.script)
        self.script = TWO_CALLS
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []

    def add_request(self, prompt, params=None, request_id=None) -> str:
        self.prompts.append(self.tokenizer.decode(prompt) if isinstance(prompt, list) else str(prompt))
        self.params.append(params)
        return super().add_request(prompt, params, request_id)


@pytest.fixture(scope="module")
def llm() -> ScriptedLLM:
    return ScriptedLLM()


@pytest.fixture(scope="module")
def client(llm: ScriptedLLM):
    engine = AsyncLLM(llm=llm)
    with running_server(engine, api_key=KEY) as url:
        yield anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    engine.shutdown()


@pytest.fixture(autouse=True)
def script(llm: ScriptedLLM):
    llm.script = TWO_CALLS
    yield


def create(client: anthropic.Anthropic, **kwargs):
    return client.messages.create(model="fake-llm", max_tokens=400, **{"messages": ASK, "tools": [WEATHER], **kwargs})


def test_calls_come_back_as_tool_use_blocks(client: anthropic.Anthropic, llm: ScriptedLLM) -> None:
    reply = create(client)
    assert reply.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in reply.content] == [
        ("tool_use", "get_weather", {"city": "Paris"}),
        ("tool_use", "get_weather", {"city": "Rome"}),
    ]
    assert all(b.id.startswith("toolu_") for b in reply.content) and reply.content[0].id != reply.content[1].id
    assert "get_weather" in llm.prompts[-1] and "The weather in a city now." in llm.prompts[-1]  # described
    plan = ToolPlan([{"type": "function", "function": {**WEATHER_FUNCTION}}], "auto")
    assert llm.params[-1].structured == constraint(plan, "generic")


@pytest.mark.parametrize(
    ("tool_choice", "choice", "name", "parallel"),
    [
        ({"type": "auto"}, "auto", None, True),
        ({"type": "any"}, "required", None, True),
        ({"type": "tool", "name": "get_weather"}, "named", "get_weather", True),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, False),
    ],
)
def test_tool_choice_is_the_plans_grammar(client, llm: ScriptedLLM, tool_choice, choice, name, parallel) -> None:
    llm.script = '{"city": "Paris"}' if choice == "named" else llm.script
    if choice == "required":
        llm.script = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    if not parallel:
        llm.script = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    reply = create(client, tools=[WEATHER, TIME], tool_choice=tool_choice)
    functions = [WEATHER_FUNCTION, {"name": "get_time", "parameters": TIME["input_schema"]}]
    plan = ToolPlan([{"type": "function", "function": f} for f in functions], choice, name, parallel)
    assert llm.params[-1].structured == constraint(plan, "generic")
    assert reply.stop_reason == "tool_use"
    assert (reply.content[0].name, reply.content[0].input) == ("get_weather", {"city": "Paris"})


def test_tool_choice_none_leaves_the_tools_out(client: anthropic.Anthropic, llm: ScriptedLLM) -> None:
    llm.script = "Sunny."
    reply = create(client, tool_choice={"type": "none"})
    assert "get_weather" not in llm.prompts[-1] and llm.params[-1].structured is None
    assert [(b.type, b.text) for b in reply.content] == [("text", "Sunny.")] and reply.stop_reason == "end_turn"


def test_an_answer_instead_of_a_call_is_text(client: anthropic.Anthropic, llm: ScriptedLLM) -> None:
    llm.script = '{"response": "I can answer that myself."}'
    reply = create(client)
    assert [(b.type, b.text) for b in reply.content] == [("text", "I can answer that myself.")]
    assert reply.stop_reason == "end_turn"


def test_the_stream_reassembles_into_the_same_calls(client: anthropic.Anthropic) -> None:
    whole = create(client)
    with client.messages.stream(model="fake-llm", max_tokens=400, messages=ASK, tools=[WEATHER]) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2
    assert "input_json" in names  # the SDK's event for each input_json_delta


def test_raw_events_say_each_blocks_index_and_kind(client: anthropic.Anthropic) -> None:
    with client.messages.with_streaming_response.create(
        model="fake-llm", max_tokens=400, messages=ASK, tools=[WEATHER], stream=True
    ) as response:
        text = response.read().decode()
    pairs = [
        (lines["event"], json.loads(lines["data"]))
        for chunk in text.strip().split("\n\n")
        for lines in [dict(line.split(": ", 1) for line in chunk.split("\n"))]
    ]
    starts = [data for name, data in pairs if name == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"], s["content_block"]["input"]) for s in starts] == [
        (0, "tool_use", {}),
        (1, "tool_use", {}),
    ]
    pieces: dict[int, str] = {}
    for name, data in pairs:
        if name == "content_block_delta":
            assert data["delta"]["type"] == "input_json_delta"
            pieces[data["index"]] = pieces.get(data["index"], "") + data["delta"]["partial_json"]
    assert {i: json.loads(p) for i, p in pieces.items()} == {0: {"city": "Paris"}, 1: {"city": "Rome"}}
    assert pairs[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_results_in_the_history_reach_the_prompt(client: anthropic.Anthropic, llm: ScriptedLLM) -> None:
    call = create(client).content[0]
    llm.script = '{"response": "18 degrees in Paris."}'
    history = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And be brief."},
            ],
        },
    ]
    reply = create(client, messages=history)
    assert reply.content[0].text == "18 degrees in Paris." and reply.stop_reason == "end_turn"
    prompt = llm.prompts[-1]
    assert '"city": "Paris"' in prompt  # the call, as the model wrote it
    assert f'"tool_call_id": "{call.id}"' in prompt and '"content": "18 C"' in prompt  # its result
    assert prompt.index("18 C") < prompt.index("And be brief.")
    counted = client.messages.count_tokens(model="fake-llm", messages=history, tools=[WEATHER])
    assert counted.input_tokens == len(prompt)  # FakeLLM's tokens are characters


def test_an_error_result_says_so(client: anthropic.Anthropic, llm: ScriptedLLM) -> None:
    call = create(client).content[0]
    llm.script = '{"response": "The lookup failed."}'
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "no such city", "is_error": True}
    create(
        client,
        messages=[*ASK, {"role": "assistant", "content": [call.model_dump()]}, {"role": "user", "content": [result]}],
    )
    assert "Error: no such city" in llm.prompts[-1]


def test_a_call_cut_off_keeps_its_block_without_input() -> None:
    """A reply cut at its token limit inside a call's arguments: the call stays, its input empty, as Anthropic's API
    leaves a truncated tool_use block."""
    plan = ToolPlan([{"type": "function", "function": WEATHER_FUNCTION}], "auto")
    cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par'
    (block,) = ReplyBlocks(plan, "generic").whole(cut)
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
    whole = ReplyBlocks(plan, "generic").whole(TWO_CALLS)
    assert [b["input"] for b in whole] == [{"city": "Paris"}, {"city": "Rome"}]
