"""Anthropic's Messages API request bodies (``/v1/messages``) as pydantic models, and how each becomes a
conversation and SamplingParams.

Checked as strictly as the OpenAI bodies (protocol.py): a wrong type is refused, not coerced. What
would change the answer if ignored (images, documents, Anthropic's server tools) is refused with a
400 naming it; what does not (``metadata``, ``thinking``, ``output_config.effort``, ``cache_control``)
is accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo, field_validator

from localpaged.errors import ConfigError
from localpaged.sampling import SamplingParams, StructuredOutputs
from localpaged.server.anthropic_tools import AnthropicTools
from localpaged.server.errors import bad_request
from localpaged.server.protocol import Whole, _kind, _Strict

ROLES = ("user", "assistant")
# Content blocks a text model cannot read: refused by name rather than dropped, so no reply answers a
# question about a picture it never saw.
UNREADABLE = ("image", "document", "search_result", "container_upload")


class AnthropicMessage(_Strict):
    role: str
    content: Any

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use user or assistant (the system prompt goes in 'system')")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content: Any, info: ValidationInfo) -> list[dict]:
        """A string, or a list of content blocks: as a list of blocks either way."""
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if isinstance(content, list):
            for block in content:
                _check_block(block, info.data.get("role"))
            return content
        raise ValueError(f"must be a string or a list of content blocks, not {_kind(content)}")

    def text(self) -> str:
        return "".join(block["text"] for block in self.content if block["type"] == "text")

    def blocks(self, kind: str) -> list[dict]:
        return [block for block in self.content if block["type"] == kind]


def _check_block(block: object, role: str | None) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in UNREADABLE:
        raise ValueError(f"{kind} blocks are not supported: the model here reads text only; send text blocks")
    if kind == "tool_use":
        if role != "assistant":
            raise ValueError("tool_use blocks belong in assistant messages (the calls the model made)")
        if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
            raise ValueError("a tool_use block needs its id and name (strings), as the reply gave them")
        if not isinstance(block.get("input"), dict):
            raise ValueError(
                f"a tool_use block's input is an object of the tool's arguments, not {_kind(block.get('input'))}"
            )
        return
    if kind == "tool_result":
        if role != "user":
            raise ValueError("tool_result blocks belong in user messages (the results of the calls)")
        if not isinstance(block.get("tool_use_id"), str):
            raise ValueError("a tool_result block needs tool_use_id, the id of the tool_use it answers")
        result = block.get("content", "")
        if isinstance(result, list):
            for inner in result:
                _check_block(inner, "tool_result")
            return
        if isinstance(result, str):
            return
        raise ValueError(f"a tool_result's content is a string or a list of text blocks, not {_kind(result)}")
    if kind != "text" or not isinstance(block.get("text"), str):
        shown = f"{_kind(block)} of type {kind!r}" if kind is not None else _kind(block)
        raise ValueError(
            f"content blocks are text ({{'type': 'text', 'text': ...}}), tool_use or tool_result, not {shown}"
        )


def _result_text(block: dict) -> str:
    """A tool_result's content as text; an error result says it failed, for the model to read."""
    result = block.get("content", "")
    text = result if isinstance(result, str) else "".join(inner["text"] for inner in result)
    return f"Error: {text}" if block.get("is_error") else text


class MessagesInput(AnthropicTools):
    """What ``/v1/messages/count_tokens`` takes: the prompt's fields alone."""

    model: str
    messages: list[AnthropicMessage]
    system: Any = None
    thinking: Any = None  # accepted and ignored: a reply without a thinking block is a reply Anthropic's API allows

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[AnthropicMessage]) -> list[AnthropicMessage]:
        if not messages:
            raise ValueError("send at least one message, e.g. [{'role': 'user', 'content': 'Hello'}]")
        return messages

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, system: Any) -> str | None:
        """A string, or a list of text blocks, joined."""
        if system is None or isinstance(system, str):
            return system
        if isinstance(system, list) and all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in system
        ):
            return "".join(b["text"] for b in system)
        raise ValueError(f"must be a string or a list of {{'type': 'text', 'text': ...}} blocks, not {_kind(system)}")

    def conversation(self) -> list[dict]:
        """The chat template's messages: the system prompt, then the turns, consecutive text turns of one role
        joined into one (as Anthropic's API combines them). An assistant's tool_use blocks are its
        ``tool_calls`` (arguments as objects, as HF templates take them); a user's tool_result blocks are
        ``tool`` turns before the user's own text."""
        turns: list[dict] = [{"role": "system", "content": self.system}] if self.system else []

        def add(role: str, text: str, calls: list[dict] | None = None) -> None:
            last = turns[-1] if turns else None
            if last is not None and last["role"] == role and not calls and not last.get("tool_calls"):
                last["content"] += "\n\n" + text
            else:
                turns.append({"role": role, "content": text, **({"tool_calls": calls} if calls else {})})

        for message in self.messages:
            if message.role == "assistant":
                calls = [
                    {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
                    for b in message.blocks("tool_use")
                ]
                add("assistant", message.text(), calls)
                continue
            results = message.blocks("tool_result")
            for block in results:
                turns.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result_text(block)})
            if message.blocks("text") or not results:
                add("user", message.text())
        return turns

    @property
    def prefilled(self) -> bool:
        """A final assistant message is the start of the reply, which goes on from it (Anthropic's prefill)."""
        return self.messages[-1].role == "assistant"


class MessagesRequest(MessagesInput):
    max_tokens: Whole
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Whole | None = None
    metadata: dict | None = None  # user_id: accepted and ignored
    stream: bool = False
    output_config: dict | None = None  # format: a JSON schema the reply must match; effort: ignored

    def sampling_params(self, max_model_len: int, tools: StructuredOutputs | None = None) -> SamplingParams:
        """The request's SamplingParams; APIError 400 naming the field when a value is out of range.

        tools: the grammar its tools hold the reply to (tool_calls.constraint), if any.
        """
        structured = self._structured()
        if structured is not None and tools is not None:
            raise bad_request(
                "tools and output_config.format both say what the reply must be; send one, or tool_choice 'none'",
                "output_config.format",
            )
        fields: dict[str, Any] = {
            # Agents send the model's whole output budget (32k, 64k) as a matter of course: the reply is
            # bounded by the context instead, and says so (stop_reason model_context_window_exceeded).
            "max_tokens": min(self.max_tokens, max_model_len) if self.max_tokens > 0 else self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,  # Anthropic's default
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
            "stop": self.stop_sequences or [],
            "structured": structured or tools,
        }
        try:
            return SamplingParams(**fields)
        except ConfigError as exc:
            name = str(exc).split("=", 1)[0].split(" ")[0]
            param = {"stop": "stop_sequences"}.get(name, name) if name in fields else None
            message = str(exc) if param is None or name == param else f"{param}{str(exc)[len(name) :]}"
            raise bad_request(message, param) from None

    def _structured(self) -> StructuredOutputs | None:
        """``output_config.format``, Anthropic's structured outputs: ``{"type": "json_schema", "schema": {...}}``."""
        form = (self.output_config or {}).get("format")
        if form is None:
            return None
        if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise bad_request(
                "output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config.format"
            )
        try:
            return StructuredOutputs(json=form["schema"])
        except ConfigError as exc:
            raise bad_request(f"output_config.format: {exc}", "output_config.format") from None
