"""Settings in the app: whole replies by default, a limit that shows in the header, the context figure, theme, keys."""

from __future__ import annotations

import pytest
from pilot_helpers import NOW, error_message, main_screen, reply_done, send, wait_for
from textual.widgets import Label

from localpaged.config_file import SamplingSettings, Settings, load_settings
from localpaged.locations import config_file_path
from localpaged.tui.app import LocalpagedApp
from localpaged.tui.screens.error import ErrorScreen
from localpaged.tui.screens.new_chat import NewChatDialog

pytestmark = pytest.mark.anyio
WORDS = 600


def long_reply(text: str) -> str:
    return " ".join(f"w{i}" for i in range(WORDS))


def headers(screen) -> list[str]:
    return [str(b.query_one(".bubble-header", Label).content) for b in screen.messages.bubbles]


async def test_a_reply_runs_to_its_end_by_default(make_app, engine, store) -> None:
    engine.default, engine.delay = long_reply, 0
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "write a lot")
        await reply_done(pilot, screen, screen.current)
        reply = screen.current.session.last_reply
        assert len(reply.content.split()) == WORDS and reply.completion_tokens == WORDS
        assert reply.finish_reason == "stop"
        assert "stopped at" not in headers(screen)[-1]


async def test_a_limit_says_so_in_the_header_also_after_a_restart(make_app, engine, store) -> None:
    engine.default, engine.delay = long_reply, 0
    app = make_app(settings=Settings(sampling=SamplingSettings(max_tokens=40)))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "write a lot")
        await reply_done(pilot, screen, screen.current)
        reply = screen.current.session.last_reply
        assert len(reply.content.split()) == 40 and reply.finish_reason == "length"
        assert headers(screen)[-1].startswith("assistant · stopped at 40 tokens")
        session_id = screen.current.session.id

    app = make_app(session_id=session_id)  # a new app over the same store: read back from the database
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await wait_for(pilot, lambda: len(screen.messages.bubbles) == 2)
        assert headers(screen)[-1].startswith("assistant · stopped at 40 tokens")


async def test_the_context_counts_the_system_prompt_history_and_reply(make_app, engine, store) -> None:
    """While a reply streams, the figure is the whole prompt plus the reply so far (was: the reply alone)."""
    system = "You are a careful programmer. " * 80
    session = store.create_session(system=system, prompt_name="coding")
    engine.default, engine.hold_at = long_reply, 3
    app = make_app(session_id=session.id)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "hello")
        chat = screen.current
        await wait_for(pilot, lambda: chat.session.live_context_tokens and len(chat.reply.split()) == 3)
        prompt = len(engine.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "hello"}]))
        assert chat.figures().context_tokens == prompt + 3
        engine.delay = 0  # the other 597 words at once: a slow machine still ends the reply inside reply_done's wait
        engine.release()
        await reply_done(pilot, screen, chat)


async def test_a_picked_theme_is_remembered(engine, store) -> None:
    def make() -> LocalpagedApp:
        return LocalpagedApp(
            engine_factory=lambda progress: engine, store=store, clock=lambda: NOW, settings=load_settings()
        )

    config = config_file_path(create=True)  # the folder made, as saving a setting makes it
    config.write_text("[sampling]\ntemperature = 0.2\n")
    app = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await main_screen(pilot)
        assert config.read_text() == "[sampling]\ntemperature = 0.2\n"  # starting writes nothing
        app.theme = "nord"
        await pilot.pause()
    assert config.read_text() == 'theme = "nord"\n[sampling]\ntemperature = 0.2\n'

    app = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await main_screen(pilot)
        assert app.theme == "nord"


async def test_the_keymap_rebinds_and_an_unknown_binding_is_explained(make_app) -> None:
    app = make_app(settings=Settings(keys={"new_chat": "f9"}))
    async with app.run_test(size=(120, 40)) as pilot:
        await main_screen(pilot)
        await pilot.press("f9")
        await wait_for(pilot, lambda: isinstance(app.screen, NewChatDialog))

    app = make_app(settings=Settings(keys={"new_chta": "f9"}))
    async with app.run_test(size=(120, 40)) as pilot:
        message = await error_message(pilot)
        assert isinstance(app.screen, ErrorScreen) and app.engine is None  # explained before the model loads
    assert "new_chta" in message and "new_chat" in message
