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
    behind the loading screen and hands it to every open chat, or, when that fails too, shows
    this screen again with the new reason: retrying stays possible until it works. Quit leaves
    as ever: the chats and their cut-short replies are already stored. For a remote engine
    (``remote``) the message is a RemoteEngineError's, which names the server's URL, and the
    action is "Connect again", in the footer as on the button.
    """

    BINDINGS = [
        Binding("r", "restart", "Restart engine", id="restart_engine"),
        Binding("r", "connect_again", "Connect again", id="connect_again"),
        Binding("q", "app.quit", "Quit", id="engine_dead_quit"),
    ]

    def __init__(self, message: str, *, remote: bool = False) -> None:
        super().__init__()
        self.message = message
        self.remote = remote

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            title = "The remote engine cannot be reached" if self.remote else "The engine stopped"
            yield Label(title, id="engine-dead-title")
            yield Static(self.message, id="engine-dead-message", markup=False)
            yield Label(
                "Your chats are saved; a reply that was cut short is kept and marked as an error.",
                id="engine-dead-hint",
            )
            with Horizontal(id="engine-dead-buttons"):
                yield Button(self.action_name, id="restart", variant="primary")
                yield Button("Quit", id="quit")
        yield Footer()

    @property
    def action_name(self) -> str:
        """The restart's one name, on the button and in the footer."""
        return "Connect again" if self.remote else "Restart engine"

    def on_mount(self) -> None:
        self.query_one("#restart", Button).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """One of the two ``r`` bindings, by what a restart does here: start the engine again, or connect again."""
        if action in ("restart", "connect_again"):
            return (action == "connect_again") == self.remote
        return True

    def action_restart(self) -> None:
        self.dismiss(True)

    def action_connect_again(self) -> None:
        self.dismiss(True)

    async def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "restart":
            self.dismiss(True)
        else:
            await self.run_action("app.quit")
