"""Session.send(schema=...) / (response_format=...): the reply is constrained by the engine and parsed into what was asked.

On the scripted FakeLLM: what the engine is asked for, what comes back parsed, and every refusal. On
the default model (marked ``model``): a JSON schema's reply validates, and send and asend agree.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pydantic
import pytest

from localpaged.chat.reply_format import ParsedMessage
from localpaged.chat.session import Session
from localpaged.chat.store import ChatStore, MessageRecord
from localpaged.engine.async_llm import AsyncLLM
from localpaged.errors import ConfigError, RequestError
from localpaged.sampling import SamplingParams, StructuredOutputs
from tests.engine.fake_llm import FakeLLM

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REPLY = '{"name": "Ada", "age": 36}'


class Person(pydantic.BaseModel):
    name: str
    age: int


class RecordingLLM(FakeLLM):
    """FakeLLM that replies REPLY and keeps every request's SamplingParams, as the engine received them."""

    def __init__(self, reply: str = REPLY) -> None:
        super().__init__(lambda ids: reply)
        self.params: list[SamplingParams] = []

    def add_request(self, prompt, params=None, request_id=None) -> str:
        self.params.append(params)
        return super().add_request(prompt, params, request_id)


@pytest.fixture
def store(tmp_path: Path):
    with ChatStore(tmp_path / "chat.db") as store:
        yield store


@pytest.fixture
def recording() -> RecordingLLM:
    return RecordingLLM()


@pytest.fixture
def engine(recording: RecordingLLM):
    engine = AsyncLLM(llm=recording)
    yield engine
    engine.shutdown()


def test_a_schema_dict_constrains_the_reply_and_parses_it(engine, recording: RecordingLLM, store: ChatStore) -> None:
    chat = Session.new(engine, store)
    reply = chat.send("Who wrote the first program?", schema=PERSON)
    assert recording.params[-1].structured == StructuredOutputs(json=PERSON)
    assert isinstance(reply, ParsedMessage) and isinstance(reply, MessageRecord)
    assert reply.parsed == {"name": "Ada", "age": 36}
    assert reply.content == REPLY and store.get_message(reply.id).content == REPLY  # the text is what is stored
    assert [m.role for m in chat.history] == ["user", "assistant"]


def test_a_pydantic_model_gives_its_instance(engine, recording: RecordingLLM, store: ChatStore) -> None:
    reply = Session.new(engine, store).send("Who?", SamplingParams(max_tokens=64, temperature=0.3), schema=Person)
    sent = recording.params[-1]
    assert sent.structured == StructuredOutputs(json=Person.model_json_schema())
    assert (sent.temperature, sent.max_tokens) == (0.3, 64)  # the caller's params, with the constraint added
    assert reply.parsed == Person(name="Ada", age=36)


@pytest.mark.parametrize(
    ("response_format", "structured"),
    [
        ({"type": "json_object"}, StructuredOutputs(json_object=True)),
        ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, StructuredOutputs(json=PERSON)),
        (StructuredOutputs(json=PERSON), StructuredOutputs(json=PERSON)),
    ],
)
def test_response_format_takes_openais_shapes_and_structured_outputs(
    engine, recording: RecordingLLM, store: ChatStore, response_format, structured
) -> None:
    reply = Session.new(engine, store).send("Who?", response_format=response_format)
    assert recording.params[-1].structured == structured
    assert reply.parsed == json.loads(REPLY)


def test_a_choice_or_plain_text_reply(store: ChatStore) -> None:
    llm = RecordingLLM("yes")
    with AsyncLLM(llm=llm) as engine:
        chat = Session.new(engine, store)
        reply = chat.send("Well?", response_format=StructuredOutputs(choice=["yes", "no"]))
        assert llm.params[-1].structured == StructuredOutputs(choice=["yes", "no"])
        assert reply.parsed == "yes"
        plain = chat.send("And?", response_format={"type": "text"})
        assert llm.params[-1].structured is None and not isinstance(plain, ParsedMessage)
        streamed = "".join(chat.stream("Again?", schema=PERSON))
        assert streamed == "yes" and llm.params[-1].structured == StructuredOutputs(json=PERSON)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schema": PERSON, "response_format": {"type": "json_object"}},
        {"schema": 42},
        {"schema": "Person"},
        {"schema": {"type": "object", "x": {1, 2}}},  # not JSON
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": "json"},
    ],
)
def test_a_bad_format_is_refused_before_anything_is_stored(engine, store: ChatStore, kwargs: dict) -> None:
    chat = Session.new(engine, store)
    with pytest.raises(ConfigError):
        chat.send("Who?", **kwargs)
    assert chat.history == []


def test_a_second_constraint_in_params_is_refused(engine, store: ChatStore) -> None:
    chat = Session.new(engine, store)
    params = SamplingParams(structured=StructuredOutputs(regex="[a-z]+"))
    with pytest.raises(ConfigError, match="pass it once"):
        chat.send("Who?", params, schema=PERSON)
    assert chat.history == []
    assert chat.send("Who?", SamplingParams(structured=StructuredOutputs(json=PERSON)), schema=PERSON).parsed


def test_a_reply_cut_at_its_limit_is_an_error_naming_max_tokens(engine, store: ChatStore) -> None:
    chat = Session.new(engine, store)
    with pytest.raises(RequestError, match="max_tokens"):
        chat.send("Who?", SamplingParams(max_tokens=5), schema=PERSON)
    assert chat.last_reply.content == REPLY[:5] and chat.last_reply.finish_reason == "length"  # kept


def test_a_reply_the_model_class_refuses_is_an_error_naming_it(store: ChatStore) -> None:
    with AsyncLLM(llm=RecordingLLM('{"name": "Ada", "age": "old"}')) as engine:
        chat = Session.new(engine, store)
        with pytest.raises(RequestError, match="Person"):
            chat.send("Who?", schema=Person)
        assert chat.last_reply.status == "complete"


def test_send_and_asend_agree(engine, recording: RecordingLLM, store: ChatStore) -> None:
    reply = Session.new(engine, store).send("Who?", schema=Person)
    twin = asyncio.run(Session.new(engine, store).asend("Who?", schema=Person))
    assert twin.parsed == reply.parsed and twin.content == reply.content
    assert recording.params[-1] == recording.params[-2]


# ----- the default model --------------------------------------------------------------------------------


@pytest.mark.model
def test_on_the_default_model_the_reply_validates_and_the_twins_agree(default_llm, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=96, temperature=0)
    with AsyncLLM(llm=default_llm) as engine, ChatStore(tmp_path / "chat.db") as store:
        reply = Session.new(engine, store).send("Describe a person, as JSON.", params, schema=PERSON)
        jsonschema.validate(reply.parsed, PERSON)
        twin = asyncio.run(Session.new(engine, store).asend("Describe a person, as JSON.", params, schema=PERSON))
        assert twin.parsed == reply.parsed
        person = Session.new(engine, store).send("Describe a person, as JSON.", params, schema=Person).parsed
        assert isinstance(person, Person)
