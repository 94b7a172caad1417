"""The screen shown while the model loads (or is converted on first use)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Label, ProgressBar


class LoadingScreen(Screen[None]):
    """A message and a progress bar fed by the engine's `progress` callback.

    A fraction of None means the step has no measurable progress: the bar then pulses.
    """

    def __init__(self, message: str = "Starting…") -> None:
        super().__init__()
        self.message = message

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label("localpaged", id="loading-title")
            yield Label(self.message, id="loading-message")
            yield ProgressBar(total=None, show_eta=False, id="loading-bar")

    def progress(self, message: str, fraction: float | None) -> None:
        self.query_one("#loading-message", Label).update(message)
        bar = self.query_one(ProgressBar)
        if fraction is None:
            bar.update(total=None)
        else:
            bar.update(total=100, progress=100 * max(0.0, min(1.0, fraction)))
