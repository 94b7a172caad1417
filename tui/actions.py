"""The chat actions that go through a dialog: new, edit & fork, rename, delete, search, export."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from textual.screen import Screen

from localpaged.chat.prompts import list_prompts
from localpaged.chat.session import Session
from localpaged.errors import LocalpagedError
from localpaged.tui.screens.confirm import ConfirmDialog
from localpaged.tui.screens.edit import EditDialog
from localpaged.tui.screens.new_chat import Choice, NewChatDialog
from localpaged.tui.screens.search import SearchDialog
from localpaged.tui.screens.text_dialog import TextDialog
from localpaged.tui.widgets.bubble import MessageBubble
from localpaged.tui.widgets.chat_input import ChatInput


class ChatActions(Screen[None]):
    """MainScreen's base: each action asks in a dialog, then changes the store and the view.

    It uses what MainScreen provides (current, adopt, open, start_reply, refresh_sidebar, ...).

    Store errors (a locked database, a vanished message) are shown as notifications: the
    chats that are streaming must not be taken down by one failed action.
    """

    def on_message_bubble_edit_requested(self, event: MessageBubble.EditRequested) -> None:
        chat, message_id = self.current, event.bubble.message_id
        if chat is None or message_id is None:
            return

        async def resend(text: str | None) -> None:
            if text:
                try:
                    fork = self.adopt(chat.session.fork_before(message_id))
                except LocalpagedError as err:
                    self.notify(str(err), severity="error")
                    return
                self.refresh_sidebar()
                await self.open(fork.session.id)
                await self.start_reply(fork, text)

        self.app.push_screen(EditDialog(event.bubble.text), resend)

    def action_new_chat(self) -> None:
        problems: list[LocalpagedError] = []  # one bad file in the prompts folder hides only itself
        try:
            prompts = list_prompts(problems)
        except LocalpagedError as err:
            problems.append(err)
            prompts = []
        for problem in problems:
            self.notify(str(problem), title="Prompt library: skipped", severity="warning", timeout=8)

        async def create(choice: Choice | None) -> None:
            if choice is not None:
                name, system = choice
                chat = self.adopt(Session.new(self.engine, self.store, system=system, prompt_name=name))
                self.refresh_sidebar()
                await self.open(chat.session.id)
                self.query_one(ChatInput).focus()

        self.app.push_screen(NewChatDialog(prompts), create)

    def action_rename(self) -> None:
        chat = self.current
        if chat is None:
            return

        def rename(title: str | None) -> None:
            if title:
                chat.session.rename(title)
                self.refresh_sidebar()
                self.show_title()

        self.app.push_screen(TextDialog("Rename chat", chat.session.title), rename)

    def action_delete(self) -> None:
        chat = self.current
        if chat is None:
            return

        async def delete(yes: bool | None) -> None:
            if not yes:
                return
            await chat.stop()
            if chat.worker is not None:
                await self.app.workers.wait_for_complete([chat.worker])  # its last write lands first
            try:
                chat.session.delete()
            except LocalpagedError as err:
                self.notify(str(err), severity="error")
                return
            del self.chats[chat.session.id]
            self.open_id = None
            self.refresh_sidebar()
            rest = self.sidebar.entries
            if rest:
                await self.open(rest[0].id)
            else:
                await self.messages.show([])
                self.show_title()
            self.notify(f"Deleted “{chat.session.title or 'Untitled'}”")

        self.app.push_screen(
            ConfirmDialog(f"Delete “{chat.session.title or 'Untitled'}” and all its messages?"), delete
        )

    def action_search(self) -> None:
        async def jump(hit: Any) -> None:
            if hit is not None:
                await self.open(hit.session_id)
                self.messages.jump_to(hit.message_id)

        self.app.push_screen(SearchDialog(self.store), jump)

    def action_export(self) -> None:
        chat = self.current
        if chat is None:
            return
        slug = re.sub(r"[^a-z0-9]+", "-", (chat.session.title or "chat").lower()).strip("-")[:40] or "chat"

        def export(path: str | None) -> None:
            if not path:
                return
            target = Path(path).expanduser()
            try:
                target.write_text(chat.session.export_markdown(), encoding="utf-8")
            except OSError as err:
                self.notify(f"Could not write {target}: {err.strerror}", severity="error")
                return
            self.notify(f"Exported to {target.resolve()}", title="Export")

        self.app.push_screen(TextDialog("Export chat to Markdown file", f"{slug}-{chat.session.id}.md"), export)
