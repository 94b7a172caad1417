"""The screen that explains why the app could not start (or could not restart its engine)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Footer, Label, Static


class ErrorScreen(Screen[None]):
    """Shows a `LocalpagedError` message, which already says what is wrong and what to do.

    A traceback would bury that advice, so only the message is shown.
    """

    BINDINGS = [Binding("q,escape,enter", "app.quit", "Quit", id="error_quit")]

    def __init__(self, message: str, title: str = "localpaged could not start") -> None:
        super().__init__()
        self.message = message
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label(self.title_text, id="error-title")
            yield Static(self.message, id="error-message", markup=False)
        yield Footer()
