"""Tools over HTTP on a model whose chat template has its own tool format (Hermes-style, as Qwen2.5's):
the template renders the definitions and the tool turns, and the calls come back as OpenAI's tool_calls.

The tiny random model with that template (tests/server/test_tool_calls.py's), so what is checked is the
path, not the model's judgement: the prompt is exactly the template's rendering with the tools, and a
required call is valid JSON of its tool's schema, streamed or not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.tokenizer import encode_chat
from tests.server.running import TINY, running_server
from tests.server.test_agent_fields import TOOLS, USER, check_weather, reassemble
from tests.server.test_tool_calls import HERMES_TEMPLATE

HISTORY = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "18 C and sunny"},
]


@pytest.fixture(scope="module")
def hermes_model(tiny_model_path: Path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-hermes")
    for f in tiny_model_path.iterdir():
        shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def engine(hermes_model: Path):
    engine = AsyncLLM(str(hermes_model), **TINY)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine: AsyncLLM):
    with running_server(engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_the_prompt_is_the_templates_rendering_of_the_tools_and_tool_turns(client, engine: AsyncLLM) -> None:
    model = engine.info.model_name
    reply = client.chat.completions.create(model=model, messages=HISTORY, tools=TOOLS, temperature=0, max_tokens=3)
    # As the server hands them to the template: the call's arguments parsed, content "" in a turn of calls alone.
    call = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    expected = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}, HISTORY[2]]
    ids = encode_chat(engine.tokenizer, expected, TOOLS)
    text = engine.tokenizer.decode(ids)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_response>\n18 C and sunny" in text
    assert reply.usage.prompt_tokens == len(ids)
    none = client.chat.completions.create(
        model=model, messages=HISTORY, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=3
    )
    assert none.usage.prompt_tokens == len(encode_chat(engine.tokenizer, expected)) < len(ids)


def test_a_required_call_in_a_template_format_is_valid_json_of_its_schema(client, engine: AsyncLLM) -> None:
    common = {
        "model": engine.info.model_name,
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 100,
    }
    choice = client.chat.completions.create(**common).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    if call.function.name == "get_weather":
        check_weather(json.loads(call.function.arguments))
    content, calls, reasons = reassemble(client.chat.completions.create(**common, stream=True))
    assert (
        content == ""
        and reasons == ["tool_calls"]
        and [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    )
