"""localpaged/chat/tool_calls.py on its own: each format's prompt, grammar and reply parsing.

Replies are written the way each format writes them, from Hypothesis-drawn calls and text, and read back
whole, a character at a time and split at random points: every way gives the same content and calls.
The grammars are checked with xgrammar itself (the replies a format writes are accepted, others not).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localpaged.chat.json_scan import JsonScanner, ScanError
from localpaged.chat.tool_calls import (
    ToolCallParser,
    ToolPlan,
    collect,
    constraint,
    detect_format,
    render,
)
from localpaged.engine.tokenizer import encode_chat, load_front_end_tokenizer

# Written for these tests in the shape of Qwen2.5's template (Hermes tool format) and of Llama 3.1's.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call functions. Their signatures within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each call return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """{%- if tools %}<|start_header_id|>system<|end_header_id|>

You have access to the following functions. To call a function, please respond with JSON for a function call.\
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\
Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", \
"parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ANYTHING = {"type": "function", "function": {"name": "record", "parameters": {"type": "object"}}}
PLAN = ToolPlan([WEATHER, ANYTHING])
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(default_model_folder: Path):
    return load_front_end_tokenizer(default_model_folder)


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


# ----- the format and the prompt ------------------------------------------------------------------


def test_the_format_comes_from_the_chat_template(tokenizer) -> None:
    assert detect_format(tokenizer.chat_template) == "generic"  # SmolLM2's has no tool format
    assert detect_format(HERMES_TEMPLATE) == "hermes"
    assert detect_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert detect_format({"default": "{{ x }}", "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert detect_format(None) == "generic"


@pytest.mark.parametrize(("template", "fmt"), [(HERMES_TEMPLATE, "hermes"), (LLAMA3_TEMPLATE, "llama3_json")])
def test_a_template_with_a_tool_format_renders_the_tools_and_the_tool_turns(tokenizer, template, fmt) -> None:
    messages, tools = render(HISTORY, PLAN, fmt)
    assert messages is HISTORY and tools == PLAN.tools
    text = tokenizer.decode(encode_chat(with_template(tokenizer, template), messages, tools))
    assert '"name": "get_weather"' in text and '"description": "The weather in a city"' in text  # the definitions
    assert '{"name": "get_weather", ' in text and '{"city": "Paris"}' in text  # the earlier call
    assert "18 C, sunny" in text
    none_messages, none_tools = render(HISTORY, dataclasses.replace(PLAN, choice="none"), fmt)
    assert none_tools is None  # "none": no tools in the prompt, the turns still rendered
    assert "The weather in a city" not in tokenizer.decode(
        encode_chat(with_template(tokenizer, template), none_messages, none_tools)
    )


def test_the_generic_format_describes_the_tools_in_the_system_message(tokenizer) -> None:
    messages, tools = render(HISTORY, PLAN, "generic")
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in messages[0]["content"] and '{"response": ' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    }
    assert messages[3]["role"] == "user"
    assert json.loads(messages[3]["content"]) == {"tool_response": {"tool_call_id": "call_1", "content": "18 C, sunny"}}
    text = tokenizer.decode(encode_chat(tokenizer, messages, tools))  # SmolLM2's own template takes them
    assert "get_weather" in text and "18 C, sunny" in text
    named, _ = render(HISTORY[1:2], dataclasses.replace(PLAN, choice="named", name="get_weather"), "generic")
    assert named[0]["content"].startswith("Call the tool get_weather")
    serial, _ = render(HISTORY, dataclasses.replace(PLAN, parallel=False), "generic")
    assert json.loads(serial[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}


# ----- the grammar --------------------------------------------------------------------------------


def accepts(plan: ToolPlan, fmt: str, text: str) -> bool:
    spec = constraint(plan, fmt)
    assert spec is not None and spec.kind == "grammar"
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(spec.grammar), text)


def test_auto_in_a_familys_own_format_is_not_constrained() -> None:
    assert constraint(PLAN, "hermes") is None and constraint(PLAN, "llama3_json") is None
    assert constraint(dataclasses.replace(PLAN, choice="none"), "generic") is None


@pytest.mark.parametrize("fmt", ["generic", "hermes", "llama3_json"])
def test_required_and_named_hold_the_call_to_the_tools_schemas(fmt: str) -> None:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    required = dataclasses.replace(PLAN, choice="required")
    assert accepts(required, fmt, json.dumps([{"name": "get_weather", key: {"city": "Oslo"}}]))
    assert not accepts(required, fmt, json.dumps([{"name": "get_weather", key: {"town": "Oslo"}}]))
    assert not accepts(required, fmt, json.dumps([{"name": "nope", key: {}}]))
    assert not accepts(required, fmt, "[]") and not accepts(required, fmt, "Sure!")
    serial = dataclasses.replace(required, parallel=False)
    two = [{"name": "record", key: {}}, {"name": "record", key: {}}]
    assert accepts(required, fmt, json.dumps(two)) and not accepts(serial, fmt, json.dumps(two))
    named = dataclasses.replace(PLAN, choice="named", name="get_weather")
    assert accepts(named, fmt, '{"city": "Oslo"}') and not accepts(named, fmt, '{"name": "get_weather"}')


def test_the_grammar_allows_no_whitespace_of_the_models_choosing() -> None:
    named = dataclasses.replace(PLAN, choice="named", name="get_weather")
    assert accepts(named, "generic", '{"city": "Oslo"}')
    assert not accepts(named, "generic", '{\t"city": "Oslo"}') and not accepts(named, "generic", '{"city":  "Oslo"}')


def test_generic_auto_allows_a_call_or_an_answer_and_nothing_else() -> None:
    assert accepts(PLAN, "generic", '{"response": "It is sunny."}')
    assert accepts(PLAN, "generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}')
    assert not accepts(PLAN, "generic", "It is sunny.")
    assert not accepts(PLAN, "generic", '{"tool_calls": [{"name": "get_weather", "arguments": {}}]}')
    serial = dataclasses.replace(PLAN, parallel=False)
    assert accepts(serial, "generic", '{"tool_call": {"name": "record", "arguments": {"x": [1, null]}}}')


# ----- reading replies ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
calls = st.lists(st.tuples(st.sampled_from(["get_weather", "record"]), arguments), min_size=1, max_size=3)
prose = st.text(max_size=40).filter(lambda t: "<tool_call>" not in t).map(str.lstrip)
dumps = st.sampled_from([json.dumps, lambda v: json.dumps(v, ensure_ascii=False), lambda v: json.dumps(v, indent=1)])
cuts = st.lists(st.integers(0, 400), max_size=8)


def read(fmt: str, plan: ToolPlan, text: str, cut_at: list[int]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The reply read whole, a character at a time, and cut at ``cut_at``: (content, [(name, arguments)]) each."""
    results = []
    for pieces in ([text], list(text), _cut(text, cut_at)):
        parser = ToolCallParser(fmt, plan)  # type: ignore[arg-type]
        deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
        content, found = collect(deltas)
        assert all(c.id.startswith("call_") for c in found)
        results.append((content, [(c.name, c.arguments) for c in found]))
    assert results[0] == results[1] == results[2]
    return results[0]


def _cut(text: str, at: list[int]) -> list[str]:
    points = sorted({min(a, len(text)) for a in at})
    return [text[i:j] for i, j in zip([0, *points], [*points, len(text)])]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=prose, made=calls, dump=dumps, cut_at=cuts)
def test_hermes_replies_read_back_whatever_the_split(content: str, made: list, dump, cut_at: list[int]) -> None:
    written = [dump(args) for _, args in made]
    text = content + "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {w}}}\n</tool_call>\n' for (name, _), w in zip(made, written)
    )
    got_content, got_calls = read("hermes", PLAN, text, cut_at)
    assert got_content == content
    assert got_calls == [(name, w) for (name, _), w in zip(made, written)]
    assert [json.loads(a) for _, a in got_calls] == [args for _, args in made]


@settings(max_examples=100, deadline=None)
@given(made=calls, dump=dumps, cut_at=cuts)
def test_llama3_json_replies_read_back_whatever_the_split(made: list, dump, cut_at: list[int]) -> None:
    written = [dump(args) for _, args in made]
    text = "; ".join(f'{{"name": "{name}", "parameters": {w}}}' for (name, _), w in zip(made, written))
    assert read("llama3_json", PLAN, text, cut_at) == ("", [(name, w) for (name, _), w in zip(made, written)])


@settings(max_examples=100, deadline=None)
@given(content=prose, cut_at=cuts)
def test_text_without_a_call_is_content_in_every_format(content: str, cut_at: list[int]) -> None:
    for fmt in ("hermes", "llama3_json"):
        if not content.startswith("{"):
            assert read(fmt, PLAN, content, cut_at) == (content, [])


@settings(max_examples=100, deadline=None)
@given(content=st.text(max_size=40), made=calls, parallel=st.booleans(), cut_at=cuts)
def test_generic_replies_read_back_whatever_the_split(content: str, made: list, parallel: bool, cut_at) -> None:
    plan = dataclasses.replace(PLAN, parallel=parallel)
    answer = json.dumps({"response": content})
    assert accepts(plan, "generic", answer)
    assert read("generic", plan, answer, cut_at) == (content, [])
    made = [("record", args) for _, args in made]  # get_weather's schema asks for a city
    objects = [{"name": name, "arguments": args} for name, args in made]
    reply = json.dumps({"tool_calls": objects} if parallel else {"tool_call": objects[0]})
    expected = made if parallel else made[:1]
    assert accepts(plan, "generic", reply)
    got_content, got_calls = read("generic", plan, reply, cut_at)
    assert got_content == "" and [(n, json.loads(a)) for n, a in got_calls] == [(n, a) for n, a in expected]


@settings(max_examples=100, deadline=None)
@given(made=calls, cut_at=cuts)
@example(made=[("get_weather", {"name": None})], cut_at=[])  # a named call's own "name" argument
def test_required_and_named_replies_read_back_whatever_the_split(made: list, cut_at: list[int]) -> None:
    reply = json.dumps([{"name": name, "arguments": args} for name, args in made])
    got = read("hermes", dataclasses.replace(PLAN, choice="required"), reply, cut_at)
    assert got[0] == "" and [(n, json.loads(a)) for n, a in got[1]] == made
    args = json.dumps(made[0][1])
    named = dataclasses.replace(PLAN, choice="named", name="record")
    assert read("generic", named, args, cut_at) == ("", [("record", args)])


@pytest.mark.parametrize(
    ("fmt", "text", "content"),
    [
        ("hermes", '<tool_call>{"name": oops}</tool_call> after', '<tool_call>{"name": oops}</tool_call> after'),
        ("hermes", "<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>"),  # a call needs a name
        ("hermes", "almost <tool_ca", "almost <tool_ca"),  # a tag that never came is text
        ("llama3_json", '{"nam', '{"nam'),  # cut off before its name: text, nothing to call
        ("generic", "Plain text, no grammar", "Plain text, no grammar"),
    ],
)
def test_what_is_not_a_call_is_content(fmt: str, text: str, content: str) -> None:
    assert read(fmt, PLAN, text, [3, 9]) == (content, [])


def test_a_call_cut_off_keeps_what_was_streamed_and_an_argumentless_call_gets_braces() -> None:
    cut = read("hermes", PLAN, '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', [])
    assert cut == ("", [("get_weather", '{"city": "Pa')])
    assert read("llama3_json", PLAN, '{"name": "record"}', []) == ("", [("record", "{}")])
    as_string = json.dumps({"tool_call": {"name": "record", "arguments": '{"a": 1}'}})
    assert read("generic", dataclasses.replace(PLAN, parallel=False), as_string, [5]) == ("", [("record", '{"a": 1}')])


def test_names_come_before_their_arguments_in_the_stream() -> None:
    parser = ToolCallParser("hermes", PLAN)
    deltas = []
    for ch in 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>':
        deltas += parser.feed(ch)
    kinds = [type(d).__name__ + ("(name)" if getattr(d, "name", None) else "") for d in deltas]
    assert kinds[0] == "ContentDelta" and "CallDelta(name)" in kinds
    first_call = kinds.index("CallDelta(name)")
    assert kinds.count("CallDelta") > 5 and kinds[first_call + 1 :] == ["CallDelta"] * (len(kinds) - first_call - 1)


@given(value=json_values, cut_at=cuts)
@settings(max_examples=200, deadline=None)
def test_the_scanner_reads_any_json_value_whatever_the_split(value, cut_at: list[int]) -> None:
    text = json.dumps([value, {"k": value}])
    scanner = JsonScanner()
    ends = []
    for piece in _cut(text, cut_at):
        events, used = scanner.feed(piece)
        ends += [e.pos for e in events if e.kind == "end" and e.path == ()]
        assert used == len(piece)
    assert scanner.done and ends == [len(text)]


@pytest.mark.parametrize("text", ['{"a" 1}', "[1,,2]", '{"a": tru}', '"\\x"', '{"a": "\x01"}', "nope"])
def test_the_scanner_refuses_what_is_not_json(text: str) -> None:
    scanner = JsonScanner()
    with pytest.raises(ScanError):
        scanner.feed(text)
        scanner.finish()
        if not scanner.done:
            raise ScanError(len(text), "unfinished")


def test_the_scanner_stops_at_the_end_of_its_value() -> None:
    scanner = JsonScanner(offset=10)
    events, used = scanner.feed("[1] 2")
    assert used == 3 and scanner.done and scanner.end == 13 and events[-1].pos == 13


def test_the_generic_format_makes_one_call_a_reply() -> None:
    from localpaged.chat.tool_calls import for_format

    assert for_format(PLAN, "generic").parallel is False
    assert for_format(PLAN, "hermes") is PLAN
