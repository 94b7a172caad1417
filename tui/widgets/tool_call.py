"""One tool call in a chat: the tool's name and its arguments, pretty-printed, with its result folded under it.

Everything here is untrusted text (the model wrote the arguments, a tool wrote the result): it is shown
as Rich Text, never parsed as markup or Markdown, and the result was already bounded and its control
characters made visible when it was stored (chat/tools.py, clean_output).
"""

from __future__ import annotations

import json

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Static

from localpaged.chat.tools import clean_output


def pretty_arguments(arguments: str) -> str:
    """A call's arguments indented for reading (as they are where they are not JSON), safe to show."""
    try:
        return clean_output(json.dumps(json.loads(arguments), indent=2, ensure_ascii=False))
    except ValueError:
        return clean_output(arguments)


def outcome_title(result: object | None) -> str:
    """What the folded part says: the result, a denial, the tool's error, or that none came."""
    if result is None:
        return "no result"
    error = getattr(result, "error", None)
    if error == "denied":
        return "denied"
    if error == "stopped":
        return "stopped before it ran"
    return f"error: {error}" if error else "result"


class ToolCallBlock(Vertical):
    """A stored call (OpenAI's shape) and its stored result message (or None), the result folded."""

    def __init__(self, call: dict, result: object | None) -> None:
        super().__init__(classes="tool-call")
        self.call = call
        self.result = result

    def compose(self) -> ComposeResult:
        yield Label(Text(f"tool call · {self.call['function']['name']}"), classes="tool-call-header")
        yield Static(Text(pretty_arguments(self.call["function"]["arguments"])), classes="tool-call-arguments")
        content = getattr(self.result, "content", "") if self.result is not None else ""
        with Collapsible(title=outcome_title(self.result), collapsed=True, classes="tool-call-result"):
            yield Static(Text(content), classes="tool-call-result-body")
