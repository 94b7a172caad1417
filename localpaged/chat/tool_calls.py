"""Tool calls in a chat: how the tools reach the prompt, what grammar holds the reply to them, and how the
reply is read back into OpenAI's ``tool_calls``, a streamed delta at a time.

The model family's own format is chosen from its chat template (``detect_format``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, text allowed around the calls
  (Qwen2.5, Qwen3, SmolLM3, Hermes templates); the template renders the tools and the tool turns.
- ``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}`` (calls joined by ``;``) or text (Llama 3.x).
- ``generic``: templates with no tool format (the default SmolLM2's): the tools are described in a system
  message, as llama.cpp's server does, and the reply is one JSON object, either
  ``{"tool_call": {"name": ..., "arguments": {...}}}`` (``"tool_calls": [...]`` when calls may be parallel)
  or ``{"response": "the answer"}``, held to that by a JSON-schema grammar.

``tool_choice`` "required" or a named function constrains the reply in every format (as vLLM does): a JSON
array of calls of the given tools, or that function's arguments alone, so the call is always valid JSON of
the tool's schema. "none" leaves the tools out of the prompt.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from localpaged.chat.json_scan import Event, JsonScanner, Path, ScanError
from localpaged.sampling import StructuredOutputs

ToolFormat = Literal["hermes", "llama3_json", "generic"]
ToolChoice = Literal["none", "auto", "required", "named"]
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama writes "parameters", the others "arguments"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    'Reply with one JSON object: {call} to call {which}, or {{"response": "your answer"}} to answer the user.'
)
GENERIC_REQUIRED = "You must call one of these tools (JSON schemas of their arguments):\n{tools}\n\nReply with {call}."
GENERIC_NAMED = (
    "Call the tool {name} ({description}): reply with a JSON object of its arguments, of this schema:\n{schema}"
)


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of its tools: their definitions (OpenAI's shape), the choice, parallel calls."""

    tools: list[dict]  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    choice: ToolChoice = "auto"
    name: str | None = None  # the function ``choice == "named"`` asks for
    parallel: bool = True

    @property
    def functions(self) -> list[dict]:
        return [tool["function"] for tool in self.tools]

    def parameters(self, name: str) -> dict:
        function = next(f for f in self.functions if f["name"] == name)
        return function.get("parameters") or {"type": "object", "properties": {}}


def for_format(plan: ToolPlan, fmt: ToolFormat) -> ToolPlan:
    """The plan as the format serves it: the generic format makes one call a reply, parallel_tool_calls or
    not. Its models were not trained to call tools, and given a list of calls a small one repeats its
    call until max_tokens (SmolLM2-135M does, for nearly every prompt)."""
    return dataclasses.replace(plan, parallel=False) if fmt == "generic" else plan


def detect_format(chat_template: str | dict | None) -> ToolFormat:
    """The tool format a chat template was written for; ``generic`` where it has none we read."""
    if isinstance(chat_template, dict):  # named templates ("default", "tool_use")
        chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    if not chat_template:
        return "generic"
    if HERMES_OPEN in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or '"parameters": dictionary of argument name' in chat_template:
        return "llama3_json"
    return "generic"


# ----- the prompt --------------------------------------------------------------------------------


def render(messages: list[dict], plan: ToolPlan | None, fmt: ToolFormat) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template: a template with a tool format gets both as they are; the
    generic format turns tool turns into text and describes the tools in a system message."""
    tools = plan.tools if plan is not None and plan.choice != "none" else None
    if fmt != "generic":
        return messages, tools
    as_json = tools is not None
    out = [_generic_message(m, plan.parallel if plan else True, as_json) for m in messages]
    if tools is None:
        return out, None
    described = json.dumps(
        [{k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None} for f in plan.functions],
        ensure_ascii=False,
    )
    if plan.parallel:
        call, which = '{"tool_calls": [{"name": "tool name", "arguments": {...}}, ...]}', "one or more tools"
    else:
        call, which = '{"tool_call": {"name": "tool name", "arguments": {...}}}', "a tool"
    if plan.choice == "auto":
        system = GENERIC_INSTRUCTIONS.format(tools=described, call=call, which=which)
    elif plan.choice == "named":
        function = next(f for f in plan.functions if f["name"] == plan.name)
        schema = json.dumps(plan.parameters(plan.name), ensure_ascii=False)
        system = GENERIC_NAMED.format(name=plan.name, description=function.get("description", ""), schema=schema)
    else:
        system = GENERIC_REQUIRED.format(tools=described, call='[{"name": "tool name", "arguments": {...}}]')
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": f"{out[0]['content']}\n\n{system}"}, *out[1:]], None
    return [{"role": "system", "content": system}, *out], None


def _generic_message(message: dict, parallel: bool, as_json: bool) -> dict:
    """A turn as plain text for a template that knows no tools: calls and results as the JSON the prompt asks for."""
    role = message["role"]
    if role == "tool":
        result = {"tool_call_id": message.get("tool_call_id"), "content": message.get("content") or ""}
        if message.get("name"):
            result["name"] = message["name"]
        return {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    if role != "assistant":
        return message
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or []
    ]
    if calls:
        body = {"tool_calls": calls} if parallel or len(calls) > 1 else {"tool_call": calls[0]}
        return {"role": "assistant", "content": json.dumps(body, ensure_ascii=False)}
    if as_json:  # the model's earlier answers in the shape it is asked to answer in
        return {
            "role": "assistant",
            "content": json.dumps({"response": message.get("content") or ""}, ensure_ascii=False),
        }
    return message


# ----- the grammar -------------------------------------------------------------------------------


def constraint(plan: ToolPlan, fmt: ToolFormat) -> StructuredOutputs | None:
    """The grammar the reply must match: none for "auto" in a family's own format (the model writes calls
    or text as it was trained to), the JSON schema of the calls otherwise (``call_schema``), as an EBNF
    grammar of compact JSON: a small model given room for whitespace fills it, call after call."""
    schema = call_schema(plan, fmt)
    return None if schema is None else schema_constraint(schema)


def schema_constraint(schema: dict, *, ebnf: bool = True) -> StructuredOutputs:
    """A reply held to ``schema``: as compact-JSON EBNF (see constraint), or (ebnf=False) the schema itself,
    for a remote server that takes OpenAI's response_format but not our grammars."""
    if not ebnf:
        return StructuredOutputs(json=schema)
    import xgrammar as xgr  # the front end imports it for any grammar; a request without tools never does

    return StructuredOutputs(grammar=str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)))


def generic_round_schema(plan: ToolPlan, choice: ToolChoice, name: str | None = None) -> dict:
    """The generic format's reply, narrowed by ``choice``, for a prompt that describes the tools as "auto"
    does (``plan``, one call a reply): "required" a call, a named call of ``name``, "none" an answer.

    A chat client's rounds differ only in this: every round's prompt stays the same rendering, so the
    engine's prefix cache serves all of it, where the server's prompts change with the choice."""
    call, answer = call_schema(dataclasses.replace(plan, choice="auto", parallel=False), "generic")["anyOf"]
    if choice == "required":
        return call
    if choice == "named":
        return _object({"tool_call": _call_schema(name or "", plan.parameters(name or ""), "arguments")})
    return answer if choice == "none" else {"anyOf": [call, answer]}


def call_schema(plan: ToolPlan, fmt: ToolFormat) -> dict | None:
    """The JSON schema of the reply ``constraint`` holds it to; None where the reply is free."""
    if plan.choice == "none" or (plan.choice == "auto" and fmt != "generic"):
        return None
    if plan.choice == "named":
        return plan.parameters(plan.name)  # type: ignore[arg-type]
    key = "parameters" if fmt == "llama3_json" else "arguments"
    one_call = {"anyOf": [_call_schema(f["name"], plan.parameters(f["name"]), key) for f in plan.functions]}
    if plan.choice == "required":
        calls = {"type": "array", "items": one_call, "minItems": 1}
        if not plan.parallel:
            calls["maxItems"] = 1
        return calls
    if plan.parallel:
        call = _object({"tool_calls": {"type": "array", "items": one_call, "minItems": 1}})
    else:
        call = _object({"tool_call": one_call})
    return {"anyOf": [call, _object({"response": {"type": "string"}})]}


def _call_schema(name: str, parameters: dict, key: str) -> dict:
    return _object({"name": {"type": "string", "enum": [name]}, key: parameters})


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# ----- reading the reply -------------------------------------------------------------------------


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallDelta:
    """A piece of tool call ``index``: its id and name come first (``arguments`` ""), then argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


Delta = ContentDelta | CallDelta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def collect(deltas: list[Delta]) -> tuple[str, list[ToolCall]]:
    """The reply's text and its whole tool calls, from its deltas."""
    text = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: list[ToolCall] = []
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.name is not None:
                calls.append(ToolCall(d.id or "", d.name, ""))
            calls[d.index].arguments += d.arguments
    return text, calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Call:
    index: int = -1  # given when the call is announced, so that calls that never were take no index
    id: str = ""
    name: str | None = None
    name_chars: list[str] = field(default_factory=list)
    args_start: int | None = None
    args_end: int | None = None
    args_string: list[str] | None = None  # arguments sent as a JSON string: its decoded text
    emitted: int = 0  # raw argument characters handed out
    announced: bool = False


class _JsonReply:
    """Tool calls (and content) inside one JSON value, as the scanner's events arrive."""

    def __init__(
        self,
        text: Callable[[], str],
        call_at: Callable[[Path], bool],
        content_at: Callable[[Path], bool],
        first_index: int,
        whole_args: str | None = None,
    ) -> None:
        self.text, self.call_at, self.content_at = text, call_at, content_at
        self.calls: dict[Path, _Call] = {}
        self.first_index = self.next_index = first_index
        self.whole_args = whole_args  # a named call: the whole value is its arguments

    def handle(self, events: list[Event], scanned: int) -> list[Delta]:
        out: list[Delta] = []
        for event in events:
            self._event(event, out)
        for call in self.calls.values():
            self._emit(call, scanned, out)
        return out

    def _event(self, event: Event, out: list[Delta]) -> None:
        path = event.path
        if self.whole_args is not None:  # a named call: every key inside is an argument, "name" too
            if path == () and event.kind == "start":
                call = self._new(())
                call.name, call.args_start = self.whole_args, event.pos
            elif path == () and event.kind == "end":
                self.calls[()].args_end = event.pos
            return
        if event.kind == "start" and event.text == "object" and self.call_at(path):
            self._new(path)
            return
        if event.kind == "chars" and self.content_at(path):
            out.append(ContentDelta(event.text))
            return
        owner = self.calls.get(path[:-1]) if path else None
        if owner is None:
            if event.kind == "end" and path in self.calls:
                self._close(self.calls[path], out)
            return
        key = path[-1]
        if key == "name":
            if event.kind == "chars":
                owner.name_chars.append(event.text)
            elif event.kind == "end":
                owner.name = "".join(owner.name_chars)
        elif key in ARGUMENT_KEYS and owner.args_start is None:
            if event.kind == "start":
                owner.args_start = event.pos
                owner.args_string = [] if event.text == "string" else None
            if event.kind == "chars" and owner.args_string is not None:
                owner.args_string.append(event.text)
            if event.kind == "end":
                owner.args_end = event.pos
        elif key in ARGUMENT_KEYS and owner.args_end is None:
            if event.kind == "chars" and owner.args_string is not None:
                owner.args_string.append(event.text)
            if event.kind == "end":
                owner.args_end = event.pos

    def _new(self, path: Path) -> _Call:
        call = _Call()
        self.calls[path] = call
        return call

    def _close(self, call: _Call, out: list[Delta]) -> None:
        if call.name is None:
            raise ScanError(call.args_start or 0, "a tool call without a name")
        if call.args_start is None:  # a call of a tool that takes no arguments
            call.args_start = call.args_end = 0
            self._emit(call, 0, out)
            out.append(CallDelta(call.index, "{}"))
            return
        self._emit(call, call.args_end or 0, out)

    def _emit(self, call: _Call, scanned: int, out: list[Delta]) -> None:
        if call.name is None:
            return
        if not call.announced:
            call.announced, call.index, call.id = True, self.next_index, new_call_id()
            self.next_index += 1
            out.append(CallDelta(call.index, "", call.id, call.name))
        if call.args_start is None or call.args_start == call.args_end == 0:
            return
        if call.args_string is not None:  # a JSON string of the arguments: handed on decoded, once whole
            if call.args_end is not None and call.emitted == 0:
                call.emitted = 1
                out.append(CallDelta(call.index, "".join(call.args_string)))
            return
        upto = call.args_end if call.args_end is not None else scanned
        start = call.args_start + call.emitted
        if upto > start:
            out.append(CallDelta(call.index, self.text()[start:upto]))
            call.emitted = upto - call.args_start


class ToolCallParser:
    """A reply read into content and tool-call deltas as it streams; the same deltas however it is split.

    ``feed`` takes each new piece of text, ``finish`` the end of the reply. Text that turns out not to be a
    call of the expected shape is handed on as content, as vLLM's parsers do.
    """

    def __init__(self, fmt: ToolFormat, plan: ToolPlan) -> None:
        self.fmt, self.plan = fmt, plan
        self.buffer = ""  # the whole reply so far
        self.done = 0  # characters of buffer dealt with
        self.text_mode = False  # everything from ``done`` on is content
        self.calls_seen = 0
        self.scanner: JsonScanner | None = None
        self.reply: _JsonReply | None = None
        self.after_call = False  # hermes: between a call's JSON and its closing tag, or after a llama call
        self.strip_space = True  # leading whitespace of the reply (and after a call) is not content
        self.call_start = 0  # where the JSON of the current call begins
        self._tagged = fmt == "hermes" and plan.choice == "auto"  # calls sit in <tool_call> tags

    # ----- input ---------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        out = self._run(final=True)
        reply = self.reply
        if self.scanner is not None and reply is not None and not self.scanner.done:
            try:
                out += reply.handle(self.scanner.finish(), len(self.buffer))
            except ScanError:
                pass
            if reply.next_index == reply.first_index:  # cut off before it named a tool: it was text
                start = self.call_start - (len(HERMES_OPEN) if self._tagged else 0)
                out.append(ContentDelta(self.buffer[start:]))
            self.scanner = None
        return out

    # ----- the modes -----------------------------------------------------------------------------

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self.done < len(self.buffer):
            before = self._state()
            if self.text_mode:
                out.append(ContentDelta(self.buffer[self.done :]))
                self.done = len(self.buffer)
            elif self.scanner is not None:
                self._scan(out)
            elif self.after_call:
                self._after_call(out, final)
            elif self.strip_space:
                rest = self.buffer[self.done :]
                stripped = rest.lstrip()
                self.done += len(rest) - len(stripped)
                if stripped:
                    self.strip_space = False
            else:
                self._between_calls(out, final)
            if self._state() == before:  # waiting for more text
                break
        if final and self.done < len(self.buffer):  # held back for a tag that never came
            out.append(ContentDelta(self.buffer[self.done :]))
            self.done = len(self.buffer)
        return [d for d in out if not (isinstance(d, ContentDelta) and not d.text)]

    def _state(self) -> tuple:
        return self.done, self.text_mode, self.scanner, self.after_call, self.strip_space

    def _between_calls(self, out: list[Delta], final: bool) -> None:
        """Outside any call: where the next one starts, by the format; before it, content."""
        rest = self.buffer[self.done :]
        if self._tagged:
            at = rest.find(HERMES_OPEN)
            if at < 0:
                keep = 0 if final else _partial_suffix(rest, HERMES_OPEN)
                out.append(ContentDelta(rest[: len(rest) - keep]))
                self.done += len(rest) - keep
                return
            out.append(ContentDelta(rest[:at]))
            self.done += at + len(HERMES_OPEN)
            self._start_scanner(call_at=lambda p: p == ())
            return
        # The JSON formats: the reply is one value, whose first character says whether it is one.
        first = rest[0]
        choice = self.plan.choice
        if choice == "named":
            self._start_scanner(call_at=lambda p: False, whole_args=self.plan.name)
        elif choice == "required" and first in "[{":
            self._start_scanner(call_at=lambda p: p == () or (len(p) == 1 and isinstance(p[0], int)))
        elif self.fmt == "generic" and first == "{":
            self._start_scanner(
                call_at=lambda p: p == ("tool_call",) or (len(p) == 2 and p[0] == "tool_calls"),
                content_at=lambda p: p == ("response",),
            )
        elif self.fmt == "llama3_json" and first == "{":
            self._start_scanner(call_at=lambda p: p == ())
        else:
            self.text_mode = True

    def _start_scanner(
        self,
        call_at: Callable[[Path], bool],
        content_at: Callable[[Path], bool] = lambda p: False,
        whole_args: str | None = None,
    ) -> None:
        self.scanner = JsonScanner(offset=self.done)
        self.reply = _JsonReply(lambda: self.buffer, call_at, content_at, self.calls_seen, whole_args)
        self.call_start = self.done

    def _scan(self, out: list[Delta]) -> None:
        scanner, reply = self.scanner, self.reply
        assert scanner is not None and reply is not None
        try:
            events, used = scanner.feed(self.buffer[self.done :])
            self.done += used
            out += reply.handle(events, self.done)
        except ScanError as exc:
            self._failed(exc.pos)
            return
        if scanner.done:
            self.calls_seen = reply.next_index
            self.scanner = None
            self.after_call = True
            self.strip_space = True

    def _failed(self, pos: int) -> None:
        """Not a call after all: what was not handed on yet is content, and so is the rest."""
        reply = self.reply
        assert reply is not None
        self.scanner = None
        self.calls_seen = reply.next_index
        if reply.next_index == reply.first_index:  # nothing of it went out: all of it is text, its tag too
            self.done = self.call_start - (len(HERMES_OPEN) if self._tagged else 0)
        else:
            self.done = max(pos, self.call_start)
        self.text_mode = True

    def _after_call(self, out: list[Delta], final: bool) -> None:
        """Between calls: hermes closes each with its tag; llama joins calls with ";"; else only space is left."""
        rest = self.buffer[self.done :]
        stripped = rest.lstrip()
        if not stripped:
            self.done = len(self.buffer)
            return
        skipped = len(rest) - len(stripped)
        if self._tagged:
            if stripped.startswith(HERMES_CLOSE):
                self.done += skipped + len(HERMES_CLOSE)
                self.after_call = False
                self.strip_space = True
                return
            if HERMES_CLOSE.startswith(stripped) and not final:
                return  # the tag may be on its way
            self.after_call = False  # no closing tag: whatever follows is text again
            self.done += skipped
            return
        if self.fmt == "llama3_json" and self.plan.choice == "auto" and stripped[0] == ";":
            self.done += skipped + 1
            self.after_call = False
            self.strip_space = True
            return
        self.done += skipped
        self.text_mode = True


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
