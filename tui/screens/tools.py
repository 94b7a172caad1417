"""The tools: every configured MCP server's state and tools (description and schema), and which of them
the open chat may use (picked here, stored with the chat)."""

from __future__ import annotations

import json

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, SelectionList, Static
from textual.widgets.selection_list import Selection

from localpaged.chat.tools import McpServers


def tools_report(servers: McpServers) -> str:
    """Each server's state, then each of its tools: name, key, description, JSON schema of the arguments."""
    if not servers.states:
        return "No MCP server is set up. Add an [mcp.servers.NAME] table to the settings file (docs/settings.md)."
    lines = []
    tools = servers.tools()
    for name, state in servers.states.items():
        lines.append(f"● {name} ({state.config.describe()}): {state.status}")
        if state.error:
            lines.append(f"  {state.error}")
        for tool in (t for t in tools if t.source == name):
            lines += ["", f"  {tool.name}  [{tool.key}]", f"  {tool.description}"]
            lines += ["  " + line for line in json.dumps(tool.parameters, indent=2, ensure_ascii=False).splitlines()]
        lines.append("")
    return "\n".join(lines)


class ToolsDialog(ModalScreen[list[str] | None]):
    """The servers and their tools; with ``chosen`` (a chat's tool keys) a list to pick the chat's tools.

    Dismisses with the picked keys (Save), or None (escape)."""

    BINDINGS = [Binding("escape", "cancel", "Close", id="tools_close")]

    def __init__(self, servers: McpServers, chosen: list[str] | None = None, disabled: str = "") -> None:
        super().__init__(classes="dialog")
        self.servers, self.chosen, self.disabled = servers, chosen, disabled

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("Tools" if self.chosen is None else "This chat's tools", classes="dialog-title")
            if self.chosen is not None:
                if self.disabled:
                    yield Label(Text(self.disabled), classes="dialog-hint")
                else:
                    options = [Selection(t.key, t.key, t.key in self.chosen) for t in self.servers.tools()]
                    yield SelectionList[str](*options, id="tools-pick")
            with VerticalScroll(classes="tools-report"):
                yield Static(Text(tools_report(self.servers)))
            with Horizontal(classes="dialog-buttons"):
                yield Button("Close", id="tools-cancel")
                if self.chosen is not None and not self.disabled:
                    yield Button("Save", id="tools-save", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "tools-save":
            self.dismiss(list(self.query_one("#tools-pick", SelectionList).selected))
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
