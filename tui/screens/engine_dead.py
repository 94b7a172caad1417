"""The screen shown when the engine's core process died: say why, offer a restart."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Horizontal, Middle
from textual.screen import Screen
from textual.widgets import Button, Footer, Label, Static


class EngineDeadScreen(Screen[bool]):
    """Shows the EngineDeadError's message (it names the cause) over the chats.

    Dismissed with True when the user asks for a restart; the app then builds a new engine
    behind the loading screen and hands it to every open chat. Quit leaves as ever: the chats
    and their cut-short replies are already stored.
    """

    BINDINGS = [
        Binding("r", "restart", "Restart engine", id="restart_engine"),
        Binding("q", "app.quit", "Quit", id="engine_dead_quit"),
    ]

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label("The engine stopped", id="engine-dead-title")
            yield Static(self.message, id="engine-dead-message", markup=False)
            yield Label(
                "Your chats are saved; a reply that was cut short is kept and marked as an error.",
                id="engine-dead-hint",
            )
            with Horizontal(id="engine-dead-buttons"):
                yield Button("Restart engine", id="restart", variant="primary")
                yield Button("Quit", id="quit")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#restart", Button).focus()

    def action_restart(self) -> None:
        self.dismiss(True)

    async def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        await self.run_action("restart" if event.button.id == "restart" else "app.quit")
