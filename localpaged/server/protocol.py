"""The OpenAI-compatible request bodies as pydantic models, and how each becomes SamplingParams.

Types are checked strictly (``"temperature": "0.5"`` is refused, not coerced), because a client
that sends a string there has a bug we should name rather than guess around. Value ranges are not
repeated here: SamplingParams checks them and says what it accepts (see ``sampling_params``), so
the server and the library refuse the same things with the same words.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from localpaged.chat.tool_calls import ToolPlan
from localpaged.errors import ConfigError
from localpaged.sampling import SamplingParams, StructuredOutputs
from localpaged.server.errors import bad_request

# What the OpenAI API calls roles; "developer" is its newer name for "system"; "function" its legacy "tool".
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_TOOLS = 128  # OpenAI's bound on the tools of one request
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's, and a dot (MCP names have them)
# vLLM's older fields for what ``structured_outputs`` now carries, and the kind each one is.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _whole_number(value: Any) -> Any:
    """JSON has one number type: 8.0 is the whole number 8 (clients that build bodies from floats send it so)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A whole number, strictly, where a float of a whole value counts as one.
Whole = Annotated[int, BeforeValidator(_whole_number)]


class _Strict(BaseModel):
    # Fields we do not know (logit_bias=None, user, metadata, ...) are ignored, as OpenAI-compatible
    # servers do; the few that would change the answer if ignored are refused in ``_refuse_unsupported``.
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"must be JSON text of the call's arguments ({exc})") from None
        if not isinstance(parsed, dict):
            raise ValueError('must be a JSON object of the call\'s arguments, e.g. \'{"city": "Paris"}\'')  # noqa: TRY004 -- pydantic reports ValueErrors
        return arguments


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # In this order: content is checked knowing the role and whether the turn makes tool calls.
    role: str
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    function_call: FunctionCall | None = None  # the legacy assistant call
    content: Any = Field(default=None, validate_default=True)  # null only in an assistant turn of tool calls
    name: str | None = None
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs name, the function whose result it is")
        if self.role != "assistant" and (self.tool_calls or self.function_call):
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any, info: ValidationInfo) -> str | None:
        """A string, or a list of text parts (``{"type": "text", "text": ...}``, as newer clients send), joined."""
        if content is None:
            calls = info.data.get("tool_calls") or info.data.get("function_call")
            if info.data.get("role") == "assistant" and calls:
                return None
            raise ValueError("content is required (null only in an assistant turn that makes tool calls)")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            return "".join(p["text"] for p in content)
        raise ValueError(f"must be a string (or a list of {{'type': 'text', 'text': ...}} parts), not {_kind(content)}")


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; none: the function takes none
    strict: bool | None = None  # OpenAI's: the call follows the schema; ours always do when constrained

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not TOOL_NAME.match(name):
            raise ValueError(f"{name!r} is not a tool name: use 1 to 64 letters, digits, '_', '-' or '.'")
        return name

    @field_validator("parameters")
    @classmethod
    def _schema(cls, parameters: dict | None) -> dict | None:
        if parameters is not None:
            try:
                StructuredOutputs(json=parameters)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedTool(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponseSchema(_Strict):
    name: str | None = None  # OpenAI asks for one; it names the schema, nothing more
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the reply always follows the schema here: the grammar holds it to it


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: ResponseSchema | None = None


class StructuredOutputsIn(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Generation(_Strict):
    """The fields chat and text completions share: which model, how to sample, how to answer."""

    model: str | None = None
    max_tokens: Whole | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Whole | None = None  # vLLM's extension; -1 (vLLM's "off") is taken as 0
    seed: Whole | None = None
    stop: Any = None
    stop_token_ids: list[Whole] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    n: Whole = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    min_p: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token ids (as JSON keys, strings) -> bias
    # What the reply must match: OpenAI's response_format, vLLM's structured_outputs or its older guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop: Any) -> Any:
        if stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            return stop
        raise ValueError(f"must be a string or a list of strings, not {_kind(stop)}")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The reply's token limit as sent, and the field that carried it (for error messages)."""
        return self.max_tokens, "max_tokens"

    def sampling_params(self, max_model_len: int) -> SamplingParams:
        """The request's SamplingParams; APIError 400 naming the field when a value is out of range.

        Without a limit the reply runs until the model stops or the context is full, as in OpenAI's
        API: the engine ends a request at max_model_len with finish_reason "length" in any case.
        """
        self._refuse_unsupported()
        max_tokens, max_field = self.requested_max_tokens()
        if max_tokens is not None and max_tokens >= max_model_len:
            raise bad_request(
                f"{max_field}={max_tokens}: the context holds {max_model_len} tokens, prompt and reply together; "
                f"ask for fewer, or leave {max_field} out to let the reply run until the context is full",
                max_field,
            )
        fields: dict[str, Any] = {
            **self._extra_fields(),
            "max_tokens": max_model_len if max_tokens is None else max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,
            "seed": self.seed,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "n": self.n,
            "structured": self.structured(),
        }
        try:
            return SamplingParams(**fields)
        except ConfigError as exc:
            # SamplingParams' messages start with the field: "temperature=-1.0: must be 0 (greedy) or more".
            name = re.match(r"[a-z_]*", str(exc)).group()  # type: ignore[union-attr]
            param = max_field if name == "max_tokens" else name if name in fields else None
            message = str(exc) if param is None or name == param else f"{param}{str(exc)[len(name) :]}"
            raise bad_request(message, param) from None

    def _extra_fields(self) -> dict[str, Any]:
        """The sampling fields beyond the basic ones, where sent (None is their "off")."""
        fields: dict[str, Any] = {}
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        logprobs = self.requested_logprobs()
        if logprobs is not None:
            fields["logprobs"] = logprobs
        return fields

    def requested_logprobs(self) -> int | None:
        """How many top tokens each position's logprobs list, or None for no logprobs (each endpoint says)."""
        return None

    def structured(self) -> StructuredOutputs | None:
        """What the reply must match, from whichever one field carried it; 400 when two do, or it is malformed."""
        sources: list[tuple[str, dict]] = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            if fmt.type == "json_object":
                sources.append(("response_format", {"json_object": True}))
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request(
                    "response_format json_schema needs json_schema.schema, the JSON schema the reply must match",
                    "response_format.json_schema",
                )
            else:
                sources.append(("response_format", {"json": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            if given.get("json_object") is False:
                given.pop("json_object")
            sources.append(("structured_outputs", given))
        for name, kind in GUIDED.items():
            if getattr(self, name) is not None:
                sources.append((name, {kind: getattr(self, name)}))
        if not sources:
            return None
        if len(sources) > 1:
            names = " and ".join(name for name, _ in sources)
            raise bad_request(f"{names} both say what the reply must match; send one of them", sources[1][0])
        name, spec = sources[0]
        try:
            return StructuredOutputs(**spec)
        except ConfigError as exc:
            raise bad_request(f"{name}: {exc}", name) from None

    def _refuse_unsupported(self) -> None:
        pass


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: Whole | None = None  # OpenAI's newer name for max_tokens; wins when both are sent
    # vLLM's fields for continuing a reply: the final (assistant) message goes on where it stops, its
    # turn left open, instead of a new assistant turn starting after it. RemoteEngine's continue uses them.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Whole | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "none", "auto", "required" or a NamedTool (see _choice)
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = Field(default=None, max_length=MAX_TOOLS)  # legacy tools
    function_call: Any = None  # legacy tool_choice: "none", "auto" or a NamedFunction

    @field_validator("tool_choice", "function_call", mode="before")
    @classmethod
    def _choice(cls, choice: Any, info: ValidationInfo) -> Any:
        """One of the words, or a named function; one error naming the field rather than each union member."""
        words = ("none", "auto", "required") if info.field_name == "tool_choice" else ("none", "auto")
        named = NamedTool if info.field_name == "tool_choice" else NamedFunction
        if choice is None or choice in words:
            return choice
        example = "{'type': 'function', 'function': {'name': ...}}" if named is NamedTool else "{'name': ...}"
        if isinstance(choice, dict):
            try:
                return named.model_validate(choice)
            except ValidationError:
                pass
        raise ValueError(f"use {', '.join(map(repr, words))} or a named function, {example}; not {_brief(choice)}")

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("send at least one message, e.g. [{'role': 'user', 'content': 'Hello'}]")
        return messages

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def legacy_functions(self) -> bool:
        """The request uses OpenAI's legacy functions/function_call, and is answered in that shape."""
        return self.functions is not None or self.function_call is not None

    def tool_plan(self) -> ToolPlan | None:
        """The request's tools and how it wants them used; None without tools. 400 for a choice that cannot be."""
        if self.tools is not None and self.functions is not None:
            raise bad_request("send tools or the legacy functions, not both", "functions")
        if self.tool_choice is not None and self.function_call is not None:
            raise bad_request("send tool_choice or the legacy function_call, not both", "function_call")
        legacy = self.legacy_functions
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] or [
            {"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions or []
        ]
        choice = self.function_call if legacy else self.tool_choice
        param = "function_call" if legacy else "tool_choice"
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise bad_request(
                f"two tools are named {duplicate!r}; give each tool its own name", "functions" if legacy else "tools"
            )
        if isinstance(choice, (NamedTool, NamedFunction)):
            name = choice.function.name if isinstance(choice, NamedTool) else choice.name
            if name not in names:
                known = ", ".join(map(repr, names)) or "none"
                raise bad_request(f"{param} names {name!r}, which is not among the tools sent ({known})", param)
            plan_choice, plan_name = "named", name
        else:
            plan_choice, plan_name = choice or ("auto" if tools else "none"), None
        if not tools:
            if plan_choice in ("required", "named"):
                raise bad_request(f"{param}={plan_choice!r} asks for a tool call; send the tools too", param)
            return None
        if plan_choice != "none" and (self.structured() is not None):
            raise bad_request(
                "tools and a response format (or structured outputs) both say what the reply must be; send one, "
                "or tool_choice 'none'",
                "response_format",
            )
        parallel = False if legacy else self.parallel_tool_calls is not False
        return ToolPlan(tools, plan_choice, plan_name, parallel)  # type: ignore[arg-type]

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.continue_final_message and self.tools and self.tool_choice != "none":
            raise bad_request("continue_final_message goes on with a reply; tools are not served with it", "tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message goes on with the final message, so add_generation_prompt must be false",
                "add_generation_prompt",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last, the reply to go on", "messages")
        if not self.add_generation_prompt and not self.continue_final_message:
            raise bad_request(
                "add_generation_prompt false is served only with continue_final_message true", "add_generation_prompt"
            )

    def conversation(self) -> list[dict]:
        return conversation(self.messages)


class CompletionRequest(_Generation):
    prompt: Any
    echo: bool = False
    suffix: str | None = None
    best_of: Whole | None = None
    logprobs: Whole | None = None  # how many top tokens each position lists; 0: the chosen token's alone

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """One prompt: a string, a list of token ids, or a list holding one string (as some clients wrap it)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            prompt = [_whole_number(t) for t in prompt]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise ValueError(f"must be one string or one list of token ids, not {_kind(prompt)}")

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.echo:
            raise bad_request("echo is not supported; leave it out", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported; leave it out", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported; leave it out", "best_of")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    def conversation(self) -> list[dict]:
        return conversation(self.messages or [])


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Whole]


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them: "developer" is the template's "system", the legacy
    "function" result a "tool" one; tool calls with their arguments parsed (as HF templates take them)."""
    out = []
    for index, m in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        message: dict[str, Any] = {"role": role, "content": m.content}
        calls = [(c.id, c.function) for c in m.tool_calls or []]
        if m.function_call is not None:
            calls.append((f"call_{index}", m.function_call))
        if calls:
            message["tool_calls"] = [
                {"id": id_, "type": "function", "function": {"name": f.name, "arguments": json.loads(f.arguments)}}
                for id_, f in calls
            ]
        if role == "tool":
            message["tool_call_id"] = m.tool_call_id or f"call_{index - 1}"
            if m.name:
                message["name"] = m.name
        out.append(message)
    return out


def has_tool_turns(messages: list[dict]) -> bool:
    """Whether a conversation holds tool calls or results, which only a tool-aware rendering shows."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def _kind(value: Any) -> str:
    """How a wrong value reads in an error message: its JSON type."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
