"""The OpenAI-compatible request bodies as pydantic models, and how each becomes SamplingParams.

Types are checked strictly (``"temperature": "0.5"`` is refused, not coerced), because a client
that sends a string there has a bug we should name rather than guess around. Value ranges are not
repeated here: SamplingParams checks them and says what it accepts (see ``sampling_params``), so
the server and the library refuse the same things with the same words.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, field_validator

from localpaged.errors import ConfigError
from localpaged.sampling import SamplingParams
from localpaged.server.errors import bad_request

# What the OpenAI API calls roles; "developer" is its newer name for "system".
ROLES = ("system", "developer", "user", "assistant")


def _whole_number(value: Any) -> Any:
    """JSON has one number type: 8.0 is the whole number 8 (clients that build bodies from floats send it so)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A whole number, strictly, where a float of a whole value counts as one.
Whole = Annotated[int, BeforeValidator(_whole_number)]


class _Strict(BaseModel):
    # Fields we do not know (logit_bias=None, user, metadata, ...) are ignored, as OpenAI-compatible
    # servers do; the few that would change the answer if ignored are refused in ``_refuse_unsupported``.
    model_config = ConfigDict(strict=True, extra="ignore")


class ChatMessage(_Strict):
    role: str
    content: Any  # required: an assistant turn of tool calls alone (content null) has no place here

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> str:
        """A string, or a list of text parts (``{"type": "text", "text": ...}``, as newer clients send), joined."""
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            return "".join(p["text"] for p in content)
        raise ValueError(f"must be a string (or a list of {{'type': 'text', 'text': ...}} parts), not {_kind(content)}")


class StreamOptions(_Strict):
    include_usage: bool = False


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
    # Accepted at their "off" values only (clients send them so); see _refuse_unsupported.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    logit_bias: Any = None

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
            "max_tokens": max_model_len if max_tokens is None else max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,
            "seed": self.seed,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
        }
        try:
            return SamplingParams(**fields)
        except ConfigError as exc:
            # SamplingParams' messages start with the field: "temperature=-1.0: must be 0 (greedy) or more".
            name = str(exc).split("=", 1)[0]
            param = max_field if name == "max_tokens" else name if name in fields else None
            message = str(exc) if param is None or name == param else f"{param}{str(exc)[len(name) :]}"
            raise bad_request(message, param) from None

    def _refuse_unsupported(self) -> None:
        if self.n != 1:
            raise bad_request(f"n={self.n}: only n=1 is served; send {self.n} requests instead", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise bad_request(f"{name} is not supported; leave it out or send 0", name)
        if self.logprobs not in (None, False, 0):
            raise bad_request("logprobs are not supported; leave logprobs out", "logprobs")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported; leave it out", "logit_bias")


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: Whole | None = None  # OpenAI's newer name for max_tokens; wins when both are sent
    # vLLM's fields for continuing a reply: the final (assistant) message goes on where it stops, its
    # turn left open, instead of a new assistant turn starting after it. RemoteEngine's continue uses them.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None  # OpenAI's legacy names for tools and tool_choice: refused as they are
    function_call: Any = None
    response_format: Any = None

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

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.tools:
            raise bad_request("tools are not supported by this server; leave tools out", "tools")
        for legacy in ("functions", "function_call"):  # refused, never ignored: a plain reply would pass for an answer
            if getattr(self, legacy) is not None:
                raise bad_request(f"{legacy} (OpenAI's legacy tool calling) is not supported; leave it out", legacy)
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request(
                f"tool_choice={self.tool_choice!r} asks for a tool call, and this server runs no tools; leave it out",
                "tool_choice",
            )
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
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
    """The messages as the chat template takes them ("developer" is the template's "system")."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in messages]


def _kind(value: Any) -> str:
    """How a wrong value reads in an error message: its JSON type."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)
