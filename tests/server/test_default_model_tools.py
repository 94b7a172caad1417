"""The default model (SmolLM2-135M-Instruct) as an agent's model, over HTTP: what it manages (marked ``model``).

Its template has no tool format, so these go through the generic one (localpaged/chat/tool_calls.py). A
constrained call is always valid JSON of the tool's schema; whether the model fills it sensibly is what
these check, on prompts it gets right greedily. docs/serving.md says plainly where it does not.
"""

from __future__ import annotations

import json

import instructor
import openai
import pytest
from pydantic import BaseModel

from localpaged.engine.async_llm import AsyncLLM
from tests.server.running import running_server

pytestmark = pytest.mark.model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def served(default_llm):
    engine = AsyncLLM(llm=default_llm)
    with running_server(engine) as url:
        yield url, engine.info.model_name
    engine.shutdown()


def ask(served, question: str, **extra) -> openai.types.chat.ChatCompletion:
    url, model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": question}]
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=80, **extra)


@pytest.mark.parametrize(
    ("question", "name", "expected"),
    [
        ("What's the weather in Paris?", "get_weather", {"city": "Paris"}),
        ("Add 3 and 4 for me.", "add", {"a": 3, "b": 4}),
    ],
)
def test_it_calls_the_right_tool_with_the_right_arguments(served, question: str, name: str, expected: dict) -> None:
    for choice in ("auto", "required"):
        reply = ask(served, question, tools=[WEATHER, ADD], tool_choice=choice).choices[0]
        assert reply.finish_reason == "tool_calls", (choice, reply)
        (call,) = reply.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == name and {k: args[k] for k in expected} == expected, (choice, call)


def test_it_answers_in_text_where_no_tool_fits(served) -> None:
    reply = ask(served, "Write a haiku about the sea.", tools=[WEATHER, ADD]).choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason == "stop" and reply.message.content


def extract_person(served, mode: str, max_tokens: int, replies: list[str] | None = None) -> Person:
    """instructor in ``mode`` against the server: the Person it extracts from one sentence (``replies``: the raw
    replies, as they come)."""
    url, model = served
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300),
        mode=getattr(instructor.Mode, mode),
    )
    if replies is not None:
        client.on("completion:response", lambda response: replies.append(response.choices[0].message.content))
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "John Smith is 31 years old."}],
        response_model=Person,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
    )


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_extracts_a_person(served, mode: str) -> None:
    person = extract_person(served, mode, 80)
    assert (person.name, person.age) == ("John Smith", 31), person


def test_instructor_json_mode_gets_a_json_object(served) -> None:
    """instructor's JSON mode sends ``response_format: json_object`` with the schema in a message: the reply is
    held to a JSON object. Which object is the model's part: this one writes the schema back (docs/serving.md),
    so instructor's own validation refuses it, not the server."""
    from instructor.core.exceptions import InstructorRetryException

    replies: list[str] = []
    try:
        assert isinstance(extract_person(served, "JSON", 200, replies), Person)
    except InstructorRetryException as exc:
        assert "validation error" in str(exc).lower(), exc
    assert len(replies) == 1 and isinstance(json.loads(replies[0]), dict), replies
