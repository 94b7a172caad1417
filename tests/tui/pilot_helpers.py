"""Helpers for Pilot tests: wait for a condition, reach the chat or an error screen, send a message, await a reply."""

from __future__ import annotations

import time
from collections.abc import Callable

from localpaged.tui.screens.engine_dead import EngineDeadScreen
from localpaged.tui.screens.error import ErrorScreen
from localpaged.tui.screens.main import MainScreen
from localpaged.tui.screens.new_chat import NewChatDialog

NOW = 1_750_000_000.0  # a fixed "now" for the sidebar's ages


async def wait_for(pilot, condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Let the app run until `condition()` holds; fail with the condition's source otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {condition.__code__.co_names}")
        await pilot.pause(0.02)


async def error_message(pilot) -> str:
    """Wait until the error screen shows its message (mounted, not merely pushed); return the text."""
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen) and app.screen.query("#error-message"))
    return str(app.screen.query_one("#error-message").content)


async def engine_dead_message(pilot) -> str:
    """Wait until the engine-died screen shows its message; return the text."""
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, EngineDeadScreen) and app.screen.query("#engine-dead-message"))
    return str(app.screen.query_one("#engine-dead-message").content)


async def main_screen(pilot) -> MainScreen:
    """Wait until the engine is up and the chat screen is showing."""
    await wait_for(pilot, lambda: any(isinstance(s, MainScreen) for s in pilot.app.screen_stack))
    await pilot.pause()
    return next(s for s in pilot.app.screen_stack if isinstance(s, MainScreen))


async def reply_done(pilot, screen: MainScreen, *chats) -> None:
    """Wait until `chats` have stopped generating and the open chat's reply is drawn in full.

    "Not generating" alone is not enough: the finished reply is drawn and given its stored id by
    a message handled a moment later, later still when the machine is busy.
    """
    await wait_for(pilot, lambda: not any(c.generating for c in chats) and screen.live_bubble is None)
    await pilot.pause()


async def send(pilot, text: str) -> None:
    """Put `text` in the chat input and press enter (typing key by key is slow under load)."""
    box = pilot.app.screen.query_one("#input")
    box.focus()
    box.text = text
    await pilot.press("enter")


async def new_chat(pilot, screen: MainScreen) -> None:
    """Open a new chat without a system prompt (the dialog's first choice) and wait until it is on screen."""
    before = screen.current
    await pilot.press("ctrl+n")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, NewChatDialog))
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.current is not before)
