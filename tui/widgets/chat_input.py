"""The multi-line prompt box at the bottom of the chat."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class ChatInput(TextArea):
    """A TextArea where enter sends and shift+enter (or ctrl+j) breaks the line.

    Many terminals send the same bytes for enter and shift+enter; ctrl+j is a newline
    everywhere, so it is bound as well. Both are bindings with ids, so they show in the footer
    and can be remapped; a key bound here runs its action instead of being typed.
    """

    BINDINGS = [
        Binding("enter", "submit", "Send", id="send", priority=False),
        Binding("shift+enter,ctrl+j", "newline", "Newline", id="newline", key_display="⇧⏎/^j"),
    ]

    class Submitted(Message):
        """The user sent the text in the box."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=True, **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        """Run this widget's own bindings before TextArea would type the key (runs first in the MRO)."""
        active = self.screen.active_bindings.get(event.key)
        if active is not None and active.node is self:
            event.stop()
            event.prevent_default()
            await self.run_action(active.binding.action)

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.clear()
            self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        self.insert("\n")
