"""Pilot tests of the engine dying under the chats: one screen says why, a restart carries on."""

from __future__ import annotations

import threading

import pytest
from fake_engine import FakeEngine
from pilot_helpers import NOW, engine_dead_message, main_screen, new_chat, reply_done, send, wait_for

from localpaged.errors import EngineDeadError, ModelNotFoundError
from localpaged.tui.app import LocalpagedApp
from localpaged.tui.live import EngineDied
from localpaged.tui.screens.engine_dead import EngineDeadScreen
from localpaged.tui.screens.error import ErrorScreen
from localpaged.tui.screens.loading import LoadingScreen
from localpaged.tui.screens.main import REFRESH_S

pytestmark = pytest.mark.anyio

LONG = " ".join(f"word{i}" for i in range(60))
CAUSE = "the engine core process died (killed by signal 9 SIGKILL); restart the engine to go on"


def stored(store, session_id):
    return [(m.role, m.content, m.status) for m in store.messages(session_id)]


async def test_engine_death_mid_reply_then_restart_and_the_chats_go_on(store):
    first = FakeEngine(hold_at=3, replies={"tell A": LONG, "tell B": LONG})
    second = FakeEngine()
    gate = threading.Event()
    built: list[FakeEngine] = []

    def factory(progress):
        if built:  # the restart: show progress, then wait for the test
            progress("Loading weights", 0.5)
            gate.wait(10)
        built.append(second if built else first)
        return built[-1]

    app = LocalpagedApp(engine_factory=factory, store=store, clock=lambda: NOW)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "tell A")
        await wait_for(pilot, lambda: screen.current and screen.current.reply)
        a = screen.current
        await new_chat(pilot, screen)
        await send(pilot, "tell B")
        b = screen.current
        await wait_for(pilot, lambda: b.reply)

        first.die(CAUSE)
        assert await engine_dead_message(pilot) == CAUSE
        await wait_for(pilot, lambda: not a.generating and not b.generating)
        await pilot.pause(3 * REFRESH_S)  # figures refreshes tick meanwhile: nothing more may pop up
        assert sum(isinstance(s, EngineDeadScreen) for s in app.screen_stack) == 1  # one for both chats
        assert not any(isinstance(s, ErrorScreen) for s in app.screen_stack)
        assert not any(n.title == "Reply failed" for n in app._notifications)
        assert first.calls_when_dead <= 3  # the figures stop asking a dead engine
        partial = {}
        for chat in (a, b):
            partial[chat] = chat.reply
            assert 0 < len(chat.reply) < len(LONG)
            assert stored(store, chat.session.id) == [
                ("user", f"tell {'A' if chat is a else 'B'}", "complete"),
                ("assistant", chat.reply, "error"),
            ]
            assert store.messages(chat.session.id)[-1].error == CAUSE

        await pilot.press("r")
        await wait_for(
            pilot,
            lambda: (
                isinstance(app.screen, LoadingScreen)
                and str(app.screen.query_one("#loading-message").content) == "Loading weights"
            ),
        )
        assert first.shut_down
        gate.set()
        await wait_for(pilot, lambda: app.screen is screen)
        assert app.engine is second and screen.engine is second
        assert set(screen.chats) == {a.session.id, b.session.id} and screen.current is b
        assert all(chat.session.engine is second for chat in screen.chats.values())
        bubble = screen.messages.bubbles[-1]
        assert (bubble.text, bubble.status) == (partial[b], "error")

        # Old news from the dead engine changes nothing now.
        screen.post_message(EngineDied(first, EngineDeadError("late")))
        await pilot.pause()
        assert app.screen is screen

        await send(pilot, "and now?")
        await wait_for(pilot, lambda: b.reply == "You said: **and now?**.")
        await reply_done(pilot, screen, b)
        assert stored(store, b.session.id) == [
            ("user", "tell B", "complete"),
            ("assistant", partial[b], "error"),
            ("user", "and now?", "complete"),
            ("assistant", "You said: **and now?**.", "complete"),
        ]
        prompt = bytes(second.prompts[-1]).decode()
        assert "tell B" in prompt and "and now?" in prompt and partial[b] not in prompt  # the error stays out
        assert screen.messages.bubbles[-1].text == "You said: **and now?**."
        await wait_for(pilot, lambda: "fake-135M" in str(screen.query_one("#status").content))


async def test_a_death_found_by_the_figures_and_a_failed_restart_are_explained(store):
    first = FakeEngine()
    built: list[FakeEngine] = []
    failures: list[str] = []
    gone = "No model at /gone. Pass --model with a local HF folder or .gguf file."

    def factory(progress):
        if built and len(failures) < 2:  # the first two restarts fail, the third works
            failures.append(gone)
            raise ModelNotFoundError(gone)
        built.append(FakeEngine() if built else first)
        return built[-1]

    app = LocalpagedApp(engine_factory=factory, store=store, clock=lambda: NOW)
    async with app.run_test(size=(120, 40)) as pilot:
        await main_screen(pilot)
        first.die(CAUSE)  # no reply in flight: the next figures refresh finds out
        assert await engine_dead_message(pilot) == CAUSE
        await pilot.press("r")
        # The restart failed too: the same screen says why, and trying again stays possible (Enter, or r).
        await wait_for(pilot, lambda: len(failures) == 1)
        assert await engine_dead_message(pilot) == gone
        assert first.shut_down and isinstance(app.screen, EngineDeadScreen)
        footer = {b.binding.description for b in app.screen.active_bindings.values()}
        assert "Restart engine" in footer and "Connect again" not in footer  # one name, as on the button
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(failures) == 2)
        assert await engine_dead_message(pilot) == gone  # tried again, failed again, still offered
        await pilot.press("r")  # the model is back: this try works
        await wait_for(pilot, lambda: len(built) == 2 and app.engine is built[1])
        await main_screen(pilot)
        assert not any(isinstance(s, EngineDeadScreen) for s in app.screen_stack)


async def test_quit_from_the_engine_dead_screen(make_app, engine, store):
    engine.hold_at, engine.replies = 3, {"long": LONG}
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "long")
        chat = screen.current
        await wait_for(pilot, lambda: chat.reply)
        engine.die(CAUSE)
        await engine_dead_message(pilot)
        await pilot.press("q")
        await wait_for(pilot, lambda: engine.shut_down)
    assert stored(store, chat.session.id)[-1][2] == "error"
