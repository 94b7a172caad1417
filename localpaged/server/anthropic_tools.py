"""Anthropic's tools on the server's tool layer (localpaged/chat/tool_calls.py): its ``tools`` and
``tool_choice`` as a ToolPlan, and the reply read back into ``text`` and ``tool_use`` content blocks,
whole or as the stream's block events.

The mapping: a tool's ``input_schema`` is a function's ``parameters``; tool_choice ``auto`` / ``any`` /
``tool`` (with ``name``) / ``none`` are the plan's auto / required / named / none, and
``disable_parallel_tool_use`` turns parallel calls off. In the history, an assistant's ``tool_use``
blocks are its tool calls and a user's ``tool_result`` blocks are ``tool`` turns (anthropic_protocol.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Literal

from pydantic import Field, field_validator

from localpaged.chat.tool_calls import CallDelta, ContentDelta, Delta, ToolCallParser, ToolFormat, ToolPlan, collect
from localpaged.errors import ConfigError
from localpaged.sampling import StructuredOutputs
from localpaged.server.errors import bad_request
from localpaged.server.protocol import _Strict

MAX_TOOLS = 128  # as the OpenAI route bounds them: every tool's schema is part of the prompt and the grammar
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")  # Anthropic's rule for a custom tool's name


class AnthropicTool(_Strict):
    """A custom tool. Anthropic's server tools (web search, code execution, ...) run on its side: refused."""

    name: str
    input_schema: dict
    description: str | None = None
    type: str | None = None  # "custom", or a server tool's versioned name

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not TOOL_NAME.match(name):
            raise ValueError(f"{name!r} is not a tool name: use 1 to 128 letters, digits, '_' or '-'")
        return name

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, schema: dict) -> dict:
        try:
            StructuredOutputs(json=schema)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return schema

    @field_validator("type")
    @classmethod
    def _custom(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(
                f"{kind!r} is one of Anthropic's server tools, which run on its servers; "
                "define the tool here with a name and an input_schema and run it yourself"
            )
        return kind


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicTools(_Strict):
    """The fields of a request that concern tools (a mixin of the request bodies)."""

    tools: list[AnthropicTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None

    def tool_plan(self) -> ToolPlan | None:
        """The tools and how to use them, in the tool layer's terms; None without tools. 400 for a bad choice."""
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice.type in ("any", "tool"):
                raise bad_request(
                    f"tool_choice {choice.type!r} asks for a tool call; send the tools too", "tool_choice"
                )
            return None
        names = [tool.name for tool in self.tools]
        if duplicate := next((n for n in names if names.count(n) > 1), None):
            raise bad_request(f"two tools are named {duplicate!r}; give each tool its own name", "tools")
        kind = "auto" if choice is None else choice.type
        if kind == "tool" and (choice is None or choice.name not in names):
            sent = None if choice is None else choice.name
            raise bad_request(f"tool_choice names {sent!r}, which is not among the tools sent ({names})", "tool_choice")
        tools = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in self.tools
        ]
        for tool in tools:
            if tool["function"]["description"] is None:
                del tool["function"]["description"]
        plan_choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[kind]
        parallel = choice is None or not choice.disable_parallel_tool_use
        return ToolPlan(tools, plan_choice, choice.name if kind == "tool" else None, parallel)  # type: ignore[arg-type,union-attr]


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for the tool layer's ``call_`` one."""
    return "toolu_" + call_id.removeprefix("call_")


def _arguments(text: str) -> dict:
    """A call's input. Arguments that are not whole JSON were cut off by the token limit (the grammar or the
    parser's scanner vouch for the rest): the block stays, with no input, as Anthropic's API leaves a
    truncated tool_use block, and stop_reason max_tokens says why."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ReplyBlocks:
    """The reply as Anthropic's content blocks: text, and tool_use when the request has tools.

    ``events(delta, final)`` gives the stream's block events for each new piece of text; ``whole(text)``
    the content of a finished reply. Both read it through the same ToolCallParser, so a streamed reply
    reassembles into the non-streamed one.
    """

    def __init__(self, plan: ToolPlan | None, fmt: ToolFormat) -> None:
        use = plan is not None and plan.choice != "none"
        self.parser = ToolCallParser(fmt, plan) if use else None  # type: ignore[arg-type]
        self.index = -1  # the open block's
        self.open: str | None = None  # its type
        self.made_calls = False

    def whole(self, text: str) -> list[dict]:
        if self.parser is None:
            return [{"type": "text", "text": text}]
        said, calls = collect(self.parser.feed(text) + self.parser.finish())
        self.made_calls = bool(calls)
        blocks = [{"type": "text", "text": said}] if said.strip() or not calls else []
        return blocks + [
            {"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": _arguments(c.arguments)}
            for c in calls
        ]

    def events(self, delta: str, final: bool, event: Callable[[str, dict], bytes]) -> list[bytes]:
        """The block events for ``delta``; with ``final`` the last block's stop (and an empty text block for
        a reply that said nothing, as every message has a block)."""
        if self.parser is None:
            pieces: list[Delta] = [ContentDelta(delta)] if delta else []
        else:
            pieces = (self.parser.feed(delta) if delta else []) + (self.parser.finish() if final else [])
        out = []
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""}, event)
                out.append(self._delta({"type": "text_delta", "text": piece.text}, event))
                continue
            assert isinstance(piece, CallDelta)
            if piece.name is not None:
                self.made_calls = True
                block = {"type": "tool_use", "id": tool_use_id(piece.id or ""), "name": piece.name, "input": {}}
                out += self._start(block, event)
            if piece.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}, event))
        if final:
            if self.index < 0:
                out += self._start({"type": "text", "text": ""}, event)
            out += self._stop(event)
        return out

    def _start(self, block: dict, event: Callable[[str, dict], bytes]) -> list[bytes]:
        out = self._stop(event)
        self.index += 1
        self.open = block["type"]
        return [*out, event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict, event: Callable[[str, dict], bytes]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _stop(self, event: Callable[[str, dict], bytes]) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]
