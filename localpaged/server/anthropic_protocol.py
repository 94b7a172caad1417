"""Anthropic's Messages API request bodies (``/v1/messages``) as pydantic models, and how each becomes a prompt
and SamplingParams.

Checked as strictly as the OpenAI bodies (protocol.py): a wrong type is refused, not coerced. What
would change the answer if ignored (tools, images) is refused with a 400 naming it; what does not
(``metadata``, ``thinking``, ``output_config.effort``, ``cache_control``) is accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from localpaged.errors import ConfigError
from localpaged.sampling import SamplingParams, StructuredOutputs
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
    def _blocks(cls, content: Any) -> list[dict]:
        """A string, or a list of content blocks: as a list of blocks either way."""
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if isinstance(content, list):
            for block in content:
                _check_block(block)
            return content
        raise ValueError(f"must be a string or a list of content blocks, not {_kind(content)}")

    def text(self) -> str:
        return "".join(block["text"] for block in self.content)


def _check_block(block: object) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in UNREADABLE:
        raise ValueError(f"{kind} blocks are not supported: the model here reads text only; send text blocks")
    if kind in ("tool_use", "tool_result"):
        raise ValueError(f"{kind} blocks are not supported: this server runs no tools yet; send text blocks")
    if kind != "text" or not isinstance(block.get("text"), str):
        shown = f"{_kind(block)} of type {kind!r}" if kind is not None else _kind(block)
        raise ValueError(f"content blocks must be {{'type': 'text', 'text': ...}}, not {shown}")


class MessagesInput(_Strict):
    """What ``/v1/messages/count_tokens`` takes: the prompt's fields alone."""

    model: str
    messages: list[AnthropicMessage]
    system: Any = None
    tools: Any = None
    tool_choice: Any = None
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

    def check(self) -> None:
        """The refusals that need more than one field's type: APIError 400 naming the field."""
        if self.tools:
            raise bad_request("tools are not supported by this server yet; leave tools out", "tools")
        if self.tool_choice not in (None, {"type": "none"}, {"type": "auto"}):
            raise bad_request(
                f"tool_choice={self.tool_choice!r} asks for a tool call, and this server runs no tools; leave it out",
                "tool_choice",
            )

    def conversation(self) -> list[dict]:
        """The chat template's messages: the system prompt, then the turns, consecutive turns of one role joined
        into one (as Anthropic's API combines them)."""
        turns: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        for message in self.messages:
            if turns and turns[-1]["role"] == message.role:
                turns[-1]["content"] += "\n\n" + message.text()
            else:
                turns.append({"role": message.role, "content": message.text()})
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

    def sampling_params(self, max_model_len: int) -> SamplingParams:
        """The request's SamplingParams; APIError 400 naming the field when a value is out of range."""
        self.check()
        fields: dict[str, Any] = {
            # Agents send the model's whole output budget (32k, 64k) as a matter of course: the reply is
            # bounded by the context instead, and says so (stop_reason model_context_window_exceeded).
            "max_tokens": min(self.max_tokens, max_model_len) if self.max_tokens > 0 else self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,  # Anthropic's default
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
            "stop": self.stop_sequences or [],
            "structured": self._structured(),
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
