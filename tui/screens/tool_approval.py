"""The question a tool call waits on: allow it once, allow the tool for the rest of the chat, or deny it."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from localpaged.tui.widgets.tool_call import pretty_arguments

Answer = str  # "once", "chat", "deny", or "stop" (escape: deny, and stop the whole turn)


class ToolApprovalDialog(ModalScreen[Answer]):
    """Shows the call (tool, where it comes from, its arguments) and dismisses with the user's answer."""

    BINDINGS = [
        Binding("y", "answer('once')", "Allow once", id="tool_allow_once"),
        Binding("a", "answer('chat')", "Allow for this chat", id="tool_allow_chat"),
        Binding("n", "answer('deny')", "Deny", id="tool_deny"),
        Binding("escape", "answer('stop')", "Stop the turn", id="tool_stop"),
    ]

    def __init__(self, name: str, source: str, arguments: str) -> None:
        super().__init__(classes="dialog")
        self.tool_name, self.source, self.arguments = name, source, arguments

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            where = "a Python function" if self.source == "python" else f"MCP server {self.source}"
            yield Label(Text(f"The model calls {self.tool_name} ({where})"), classes="dialog-title")
            with VerticalScroll(classes="tool-approval-arguments"):
                yield Static(Text(pretty_arguments(self.arguments)))
            with Horizontal(classes="dialog-buttons"):
                yield Button("Deny (n)", id="tool-deny", variant="error")
                yield Button("Allow for this chat (a)", id="tool-allow-chat")
                yield Button("Allow once (y)", id="tool-allow-once", variant="primary")
            yield Label("escape: deny and stop the turn", classes="dialog-hint")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        answers = {"tool-deny": "deny", "tool-allow-chat": "chat", "tool-allow-once": "once"}
        self.dismiss(answers[event.button.id or ""])

    def action_answer(self, answer: str) -> None:
        self.dismiss(answer)
