"""What shape a Session's reply must take (``schema=`` / ``response_format=``), and the reply parsed into it.

The engine constrains the reply (``SamplingParams.structured``, compiled by xgrammar), so the text
matches; this module turns what the caller passed into that constraint, and the stored reply's text
back into the object the caller asked for: a dict for a JSON schema, the model's instance for a
pydantic model class, the text itself for a regex, choice or grammar.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from localpaged.chat.store import MessageRecord
from localpaged.errors import ConfigError, RequestError
from localpaged.sampling import StructuredOutputs


@dataclass(frozen=True)
class ParsedMessage(MessageRecord):
    """A stored assistant message, and its text parsed into the shape the turn asked for.

    ``parsed`` is not stored: the database keeps the text (``content``), as for every reply.
    """

    parsed: Any = None


@dataclass(frozen=True)
class ReplyFormat:
    """A turn's constraint (None: free text) and what its reply is parsed into (a pydantic model class, or None)."""

    structured: StructuredOutputs | None = None
    model: type | None = None

    def parse(self, reply: MessageRecord) -> MessageRecord:
        """``reply`` as a ParsedMessage; the reply itself when the turn had no format.

        RequestError when the text is not what was asked for: it stopped before the JSON ended (a token
        limit), or a pydantic model's own validators refuse it. The reply stays stored either way.
        """
        if self.structured is None:
            return reply
        if reply.status != "complete":
            raise RequestError(f"the reply is {reply.status} ({reply.error or 'stopped'}), so it has nothing to parse")
        if reply.finish_reason == "length" and self.structured.kind in ("json", "json_object"):
            raise RequestError(
                f"the reply stopped at its token limit ({reply.completion_tokens} tokens) before its JSON was "
                "complete; raise max_tokens, or ask for a smaller object"
            )
        return ParsedMessage(
            **{f.name: getattr(reply, f.name) for f in dataclasses.fields(reply)}, parsed=self._value(reply.content)
        )

    def _value(self, text: str) -> Any:
        if self.structured is None or self.structured.kind not in ("json", "json_object"):
            return text
        if self.model is not None:
            from pydantic import ValidationError

            try:
                return self.model.model_validate_json(text)
            except ValidationError as exc:
                raise RequestError(f"the reply does not validate as {self.model.__name__}: {exc}") from None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise RequestError(f"the reply is not valid JSON ({exc}): {text[:200]!r}") from None


def reply_format(schema: object = None, response_format: object = None) -> ReplyFormat:
    """The ReplyFormat of ``send(schema=...)`` or ``send(response_format=...)``; ConfigError for a bad one.

    schema: a JSON schema (a dict) or a pydantic model class. response_format: StructuredOutputs, or
    OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``, ``{"type": "json_object"}``
    or ``{"type": "text"}``.
    """
    if schema is not None and response_format is not None:
        raise ConfigError("pass schema= or response_format=, not both (schema= is the shortcut for a JSON schema)")
    if schema is not None:
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            return ReplyFormat(StructuredOutputs(json=schema.model_json_schema()), schema)
        if isinstance(schema, dict):
            return ReplyFormat(StructuredOutputs(json=schema))
        raise ConfigError(
            f"schema={_brief(schema)}: use a JSON schema (a dict) or a pydantic model class, "
            "e.g. schema={'type': 'object', 'properties': {'name': {'type': 'string'}}}"
        )
    if response_format is None or isinstance(response_format, StructuredOutputs):
        return ReplyFormat(response_format)
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind == "text":
            return ReplyFormat()
        if kind == "json_object":
            return ReplyFormat(StructuredOutputs(json_object=True))
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            if isinstance(inner, dict) and isinstance(inner.get("schema"), dict):
                return ReplyFormat(StructuredOutputs(json=inner["schema"]))
    raise ConfigError(
        f"response_format={_brief(response_format)}: use StructuredOutputs(...), {{'type': 'json_object'}}, "
        "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}} or {'type': 'text'}"
    )


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
