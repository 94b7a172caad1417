"""A one-line text question: a chat's new title, the path to export to."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class TextDialog(ModalScreen[str | None]):
    """Dismisses with the entered text (enter), or None (escape); the default is pre-filled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog_cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__(classes="dialog")
        self.title_text = title
        self.value = value
        self.placeholder = placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            yield Input(self.value, placeholder=self.placeholder, select_on_focus=False)
            yield Label("enter to confirm · escape to cancel", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
