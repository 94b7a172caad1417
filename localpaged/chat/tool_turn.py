"""What a turn with tools says as it goes (TurnEvent), and the steps its one body asks its drivers for.

A turn with tools is rounds: the model replies; if it called tools, each call is shown, approved (or
not) and run, its result stored as a "tool" message, and the model replies again, until it answers in
text or the turn's ``max_tool_rounds`` are used up (then a last reply without tools). Session writes that
once, as a generator of Steps; its sync and async twins only carry each Step out (run a reply, ask the
approve callback, run the tool) and send the answer back in, so both take exactly the same turns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from localpaged.errors import ConfigError

if TYPE_CHECKING:
    from localpaged.chat.tools import Tool
    from localpaged.sampling import SamplingParams

Approval = Literal["once", "chat", "deny"]  # allow this call, allow this tool for the rest of the chat, refuse
APPROVALS = ("once", "chat", "deny")
MAX_TOOL_ROUNDS = 8  # rounds of calls a turn may make before the model must answer in text
MAX_ROUND_TOKENS = 1024  # a round's reply when the user set no limit (see Session._tool_turn)
DENIED = "The user did not allow this call."
STOPPED = "The user stopped the turn before this call ran."


@dataclass(frozen=True)
class ToolCallRequest:
    """A call the model made: its id, the tool's name, the arguments' JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TextDelta:
    """A piece of the reply's text."""

    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """The model called a tool; ``message_id``: the stored assistant message that holds the call."""

    call: ToolCallRequest
    message_id: int


@dataclass(frozen=True)
class ToolResultEvent:
    """A call's outcome, as stored (message ``message_id``, role "tool") and sent to the model.

    ``error``: None for a result; else "denied", "stopped", or the tool's error in words.
    """

    call: ToolCallRequest
    content: str
    error: str | None
    message_id: int


TurnEvent = TextDelta | ToolCallEvent | ToolResultEvent

# An approve callback: given the call and its tool, "once", "chat" or "deny" (True/False for once/deny),
# or an awaitable of one (the async twins await it).
Approve = Callable[[ToolCallRequest, "Tool"], "Approval | bool | Awaitable[Approval | bool]"]


@dataclass(frozen=True)
class Generate:
    """Run one reply of ``prompt``; the driver sends back its stored MessageRecord."""

    prompt: Any  # session._Prompt
    params: SamplingParams
    parser: Any  # a ToolCallParser, or None for a reply without tools


@dataclass(frozen=True)
class Ask:
    """Ask the approve callback about ``call``; the driver sends back its Approval."""

    call: ToolCallRequest
    tool: Tool


@dataclass(frozen=True)
class Run:
    """Run ``tool`` on ``call``; the driver sends back (content, error) (error None on success)."""

    call: ToolCallRequest
    tool: Tool


@dataclass(frozen=True)
class Emit:
    """Hand ``event`` to whoever consumes the turn."""

    event: TurnEvent


Step = Generate | Ask | Run | Emit


def approval(answer: object) -> Approval:
    """An approve callback's answer as an Approval; ConfigError for anything else."""
    if answer is True:
        return "once"
    if answer is False:
        return "deny"
    if answer in APPROVALS:
        return answer  # type: ignore[return-value]
    raise ConfigError(f"approve returned {answer!r}; return one of {', '.join(APPROVALS)} (or True / False)")
