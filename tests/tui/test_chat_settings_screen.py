"""A chat's own settings in the app (the settings dialog, the title line) and continuing a reply cut off at a limit."""

from __future__ import annotations

import dataclasses

import pytest
from pilot_helpers import main_screen, reply_done, send, wait_for
from textual.widgets import Input, Label, TextArea

from localpaged.config_file import SamplingSettings, Settings
from localpaged.engine.protocol import LOCAL
from localpaged.tui.screens.chat_settings import ChatSettingsDialog
from localpaged.tui.screens.main import MainScreen

pytestmark = pytest.mark.anyio
WORDS = 100


def long_reply(text: str) -> str:
    return " ".join(f"w{i}" for i in range(WORDS))


def title(screen: MainScreen) -> str:
    return str(screen.query_one("#chat-title", Label).content)


async def open_settings(pilot) -> ChatSettingsDialog:
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatSettingsDialog))
    await pilot.pause()
    return pilot.app.screen


async def test_the_settings_dialog_sets_the_next_replys_temperature_and_limit(make_app, engine, store) -> None:
    engine.default, engine.delay = long_reply, 0
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "hello")
        await reply_done(pilot, screen, screen.current)
        assert engine.params[-1].temperature == 0.7 and engine.params[-1].max_tokens > 1000  # the defaults

        dialog = await open_settings(pilot)
        dialog.query_one("#setting-temperature", Input).value = "0.3"
        dialog.query_one("#setting-max_tokens", Input).value = "40"
        await pilot.click("#settings-save")
        await wait_for(pilot, lambda: app.screen is screen)
        assert "temp 0.3, max 40 tokens" in title(screen)
        assert store.session_settings(screen.current.session.id) == {"temperature": 0.3, "max_tokens": 40}

        await send(pilot, "again")
        await reply_done(pilot, screen, screen.current)
        assert (engine.params[-1].temperature, engine.params[-1].max_tokens) == (0.3, 40)
        assert screen.current.session.last_reply.completion_tokens == 40


async def test_a_bad_value_is_shown_in_the_dialog_and_nothing_is_saved(make_app, engine, store) -> None:
    engine.delay = 0
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "hello")
        await reply_done(pilot, screen, screen.current)
        dialog = await open_settings(pilot)
        dialog.query_one("#setting-top_p", Input).value = "1.5"
        await pilot.click("#settings-save")
        await pilot.pause()
        assert app.screen is dialog
        assert "top_p" in str(dialog.query_one("#settings-error", Label).content)
        box = dialog.query_one("#setting-top_p", Input)
        box.value = "lots"
        box.focus()
        await pilot.press("enter")  # enter in a box saves too
        await pilot.pause()
        assert "must be a number" in str(dialog.query_one("#settings-error", Label).content)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen)
        assert store.session_settings(screen.current.session.id) == {}


async def test_continue_is_off_for_a_whole_reply_and_grows_a_limited_one(make_app, engine, store) -> None:
    engine.default, engine.delay = long_reply, 0
    app = make_app(settings=Settings(sampling=SamplingSettings(max_tokens=30)))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        chat = None
        await send(pilot, "write a lot")
        chat = screen.current
        await reply_done(pilot, screen, chat)
        reply = chat.session.last_reply
        assert reply.finish_reason == "length" and len(reply.content.split()) == 30
        assert screen.check_action("continue", ()) is True

        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: not chat.generating and chat.session.last_reply.completion_tokens == 60)
        await reply_done(pilot, screen, chat)
        grown = chat.session.last_reply
        assert grown.id == reply.id and grown.content == " ".join(f"w{i}" for i in range(60))
        assert [b.role for b in screen.messages.bubbles] == ["user", "assistant"]
        assert screen.messages.bubbles[-1].text == grown.content and screen.messages.bubbles[-1].message_id == reply.id
        prompt = engine.prompts[-1]
        assert engine.decode(prompt).endswith("<|assistant|>" + reply.content)  # no end-of-turn before the rest

        # The rest of the script: the reply ends on its own and continue is off again.
        screen.current.session.set_settings({"max_tokens": 1000})
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: not chat.generating and chat.session.last_reply.finish_reason == "stop")
        await reply_done(pilot, screen, chat)
        assert chat.session.last_reply.content == long_reply("")
        assert not screen.check_action("continue", ())
        engine_calls = len(engine.prompts)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert len(engine.prompts) == engine_calls  # nothing was asked of the engine


async def test_continue_is_in_the_command_palette_only_when_a_reply_can_go_on(make_app, engine) -> None:
    engine.default, engine.delay = long_reply, 0
    app = make_app(settings=Settings(sampling=SamplingSettings(max_tokens=30)))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        titles = [command.title for command in app.get_system_commands(screen)]
        assert "Continue" not in titles and "Chat settings" in titles and "Stop" in titles
        await send(pilot, "write a lot")
        await reply_done(pilot, screen, screen.current)
        assert "Continue" in [command.title for command in app.get_system_commands(screen)]


async def test_a_new_system_prompt_forks_the_chat_and_the_original_keeps_the_old_one(make_app, engine, store) -> None:
    engine.delay = 0
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "hello")
        original = screen.current
        await reply_done(pilot, screen, original)
        dialog = await open_settings(pilot)
        dialog.query_one("#setting-system", TextArea).text = "You answer in French."
        dialog.query_one("#setting-temperature", Input).value = "0.2"
        await pilot.click("#settings-save")
        await wait_for(pilot, lambda: app.screen is screen and screen.current is not original)
        fork = screen.current.session
        assert fork.parent_id == original.session.id and fork.system == "You answer in French."
        assert [m.content for m in fork.history] == [m.content for m in original.session.history]
        assert fork.settings == {"temperature": 0.2}
        assert store.get_session(original.session.id).system is None
        assert "custom system prompt" in title(screen)

        await send(pilot, "and now?")
        await reply_done(pilot, screen, screen.current)
        assert "You answer in French." in engine.decode(engine.prompts[-1])
        assert len(store.messages(original.session.id)) == 2


async def test_a_new_system_prompt_on_an_empty_chat_changes_it_in_place(make_app, engine, store) -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        chat = screen.adopt(screen.new_session())
        await screen.open(chat.session.id)
        dialog = await open_settings(pilot)
        dialog.query_one("#setting-system", TextArea).text = "Be brief."
        await pilot.click("#settings-save")
        await wait_for(pilot, lambda: app.screen is screen)
        assert screen.current is chat and store.get_session(chat.session.id).system == "Be brief."
        assert len(store.list_sessions()) == 1


async def test_continue_is_dimmed_with_a_note_where_the_engine_cannot(make_app, engine) -> None:
    """A remote server that cannot go on from a partial reply: continue shows, dimmed, and says why."""
    engine.default, engine.delay = long_reply, 0
    capabilities = dataclasses.replace(LOCAL, continue_reply=False, notes={"continue_reply": "this server cannot"})
    engine.info = dataclasses.replace(engine.info, capabilities=capabilities)
    app = make_app(settings=Settings(sampling=SamplingSettings(max_tokens=30)))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "write a lot")
        chat = screen.current
        await reply_done(pilot, screen, chat)
        assert chat.session.last_reply.finish_reason == "length"
        assert screen.check_action("continue", ()) is None  # in the footer, dimmed
        calls = len(engine.prompts)
        await screen.action_continue()  # as the palette would run it
        await pilot.pause()
        assert [n.message for n in app._notifications] == ["Continue is off on this engine: this server cannot."]
        assert len(engine.prompts) == calls
