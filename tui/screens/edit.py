"""Edit an earlier message before resending it in a fork of the chat."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, TextArea


class EditDialog(ModalScreen[str | None]):
    """Multi-line editing; ctrl+s resends (enter stays a newline while editing)."""

    BINDINGS = [
        Binding("ctrl+s", "resend", "Resend in a fork", id="edit_resend", priority=True),
        Binding("escape", "cancel", "Cancel", id="edit_cancel"),
    ]

    def __init__(self, text: str) -> None:
        super().__init__(classes="dialog")
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label("Edit the message; it is resent in a new chat forked before it", classes="dialog-title")
            yield TextArea(self.text, id="edit-text", soft_wrap=True)
            yield Label("ctrl+s resend · escape cancel", classes="dialog-hint")

    def action_resend(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
