"""The open chat's messages, one bubble each."""

from __future__ import annotations

from collections.abc import Iterable

from textual.containers import VerticalScroll

from localpaged.tui.widgets.bubble import MessageBubble


class MessageList(VerticalScroll):
    """A scrolling column of bubbles, anchored to the bottom while a reply grows.

    Tokens only ever touch the last bubble, so a long chat costs nothing per token; the whole
    list is rebuilt only when another chat is opened.
    """

    async def show(self, bubbles: Iterable[MessageBubble]) -> None:
        """Replace the shown messages, e.g. when switching chats."""
        for bubble in self.bubbles:
            await bubble.close_stream()
        await self.remove_children()
        await self.mount_all(list(bubbles))
        self.anchor()

    async def add(self, bubble: MessageBubble) -> None:
        """Append one message and keep the newest in view."""
        await self.mount(bubble)
        self.anchor()

    @property
    def bubbles(self) -> list[MessageBubble]:
        return list(self.query_children(MessageBubble))

    def find(self, message_id: str) -> MessageBubble | None:
        """The bubble of a stored message, if it is shown."""
        return next((b for b in self.bubbles if b.message_id == message_id), None)

    def jump_to(self, message_id: str) -> bool:
        """Scroll a message into view and focus it (used by search)."""
        bubble = self.find(message_id)
        if bubble is None:
            return False
        self.release_anchor()
        self.scroll_to_widget(bubble, animate=False, top=True)
        bubble.focus(scroll_visible=False)
        return True
