"""Pilot tests of the chat flows on the fake engine, with the real Session and ChatStore."""

from __future__ import annotations

import dataclasses

import pytest
from pilot_helpers import error_message, main_screen, new_chat, reply_done, send, wait_for

from localpaged.errors import ModelNotFoundError
from localpaged.tui.app import LocalpagedApp
from localpaged.tui.screens.confirm import ConfirmDialog
from localpaged.tui.screens.edit import EditDialog
from localpaged.tui.screens.error import ErrorScreen
from localpaged.tui.screens.loading import LoadingScreen
from localpaged.tui.screens.new_chat import NewChatDialog
from localpaged.tui.screens.search import SearchDialog
from localpaged.tui.widgets.sidebar import LIVE_MARK

pytestmark = pytest.mark.anyio

LONG = " ".join(f"word{i}" for i in range(60))


def stored(store, session_id):
    return [(m.role, m.content, m.status) for m in store.messages(session_id)]


async def test_two_chats_stream_at_once_and_switching_back_shows_the_growing_reply(make_app, engine, store):
    engine.hold_at, engine.replies = 20, {"tell A": LONG, "tell B": LONG}
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "tell A")
        await wait_for(pilot, lambda: screen.current and screen.current.reply)
        a = screen.current
        await new_chat(pilot, screen)
        await send(pilot, "tell B")
        b = screen.current
        await wait_for(pilot, lambda: b.reply)
        assert a.generating and b.generating
        assert str(screen.sidebar.get_option_at_index(0).prompt).count(LIVE_MARK) == 1
        assert all(e.live for e in screen.sidebar.entries)
        # Back on A, its bubble shows what A has so far, and keeps growing.
        await pilot.press("alt+2")
        assert screen.current is a
        seen = len(screen.live_bubble.text)
        assert seen > 0 and a.reply.startswith(screen.live_bubble.text)
        engine.release()
        await wait_for(pilot, lambda: len(screen.live_bubble.text) > seen)
        assert a.reply.startswith(screen.live_bubble.text)
        await reply_done(pilot, screen, a, b)
        assert screen.messages.bubbles[-1].text == LONG
        assert screen.messages.bubbles[-1].status == "complete"
        for chat, text in ((a, "tell A"), (b, "tell B")):
            assert stored(store, chat.session.id) == [("user", text, "complete"), ("assistant", LONG, "complete")]
        assert not any(e.live for e in screen.sidebar.entries)


async def test_switch_with_ctrl_arrows_while_streaming(make_app, engine, store):
    engine.hold_at, engine.replies = 10, {"go": LONG}
    other = store.create_session(title="Other")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        assert screen.open_id == other.id
        await pilot.press("ctrl+n", "enter")
        await send(pilot, "go")
        chat = screen.current
        await wait_for(pilot, lambda: chat.reply)
        await pilot.press("ctrl+down")
        assert screen.open_id == other.id and screen.live_bubble is None
        before = len(chat.reply)
        engine.hold_at = 30
        await wait_for(pilot, lambda: len(chat.reply) > before + 20)  # accumulates while hidden
        await pilot.press("ctrl+up")
        assert screen.current is chat
        assert len(screen.live_bubble.text) > before + 20 and chat.reply.startswith(screen.live_bubble.text)
        await wait_for(pilot, lambda: screen.live_bubble.text == chat.reply)  # drawn every REDRAW_S, not per token
        engine.release()
        await reply_done(pilot, screen, chat)
        assert screen.messages.bubbles[-1].text == LONG
        assert stored(store, chat.session.id)[-1] == ("assistant", LONG, "complete")


async def test_stop_keeps_the_partial_reply_marked(make_app, engine, store):
    engine.hold_at, engine.replies = 10, {"long please": LONG}
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "long please")
        chat = screen.current
        await wait_for(pilot, lambda: len(chat.reply) > 20)
        await pilot.press("escape")
        await reply_done(pilot, screen, chat)
        bubble = screen.messages.bubbles[-1]
        assert bubble.status == "partial" and "stopped" in str(bubble.query_one(".bubble-header").content)
        assert 20 < len(bubble.text) < len(LONG)
        assert stored(store, chat.session.id)[-1] == ("assistant", bubble.text, "partial")


async def test_regenerate_replaces_the_last_reply(make_app, engine, store):
    answers = iter(["first answer", "second answer"])
    engine.default = lambda text: next(answers)
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "question")
        chat = screen.current
        await wait_for(pilot, lambda: chat.reply)
        await reply_done(pilot, screen, chat)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: chat.reply == "second answer")
        await reply_done(pilot, screen, chat)
        assert [(b.role, b.text) for b in screen.messages.bubbles] == [
            ("user", "question"),
            ("assistant", "second answer"),
        ]
        assert stored(store, chat.session.id) == [
            ("user", "question", "complete"),
            ("assistant", "second answer", "complete"),
        ]


async def test_edit_an_earlier_message_resends_it_in_a_fork(make_app, store):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        for text in ("first", "second"):
            await send(pilot, text)
            await wait_for(pilot, lambda: screen.current.reply)
            await reply_done(pilot, screen, screen.current)
        original = screen.current.session.id
        second = screen.messages.bubbles[2]
        assert second.role == "user" and second.message_id is not None
        second.focus()
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, EditDialog))
        app.screen.query_one("#edit-text").text = "second, edited"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: screen.open_id != original)
        fork = screen.current
        await wait_for(pilot, lambda: fork.reply)
        await reply_done(pilot, screen, fork)
        assert store.get_session(fork.session.id).parent_id == original
        assert [m[1] for m in stored(store, fork.session.id)] == [
            "first",
            "You said: **first**.",
            "second, edited",
            "You said: **second, edited**.",
        ]
        assert [m[1] for m in stored(store, original)][2] == "second"
        assert [b.text for b in screen.messages.bubbles][-2:] == ["second, edited", "You said: **second, edited**."]


async def test_delete_asks_first(make_app, store):
    keep = store.create_session(title="Keep me")
    gone = store.create_session(title="Delete me")
    store.add_message(gone.id, "user", "bye")
    app = make_app(session_id=gone.id)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        assert screen.open_id == gone.id
        await pilot.press("f8")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("n")
        assert [s.id for s in store.list_sessions()] == [gone.id, keep.id]
        await pilot.press("f8")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await wait_for(pilot, lambda: screen.open_id == keep.id)
        assert [s.id for s in store.list_sessions()] == [keep.id]
        assert [e.id for e in screen.sidebar.entries] == [keep.id]


async def test_search_jumps_to_the_hit(make_app, store):
    target = store.create_session(title="Pasta")
    store.add_message(target.id, "user", "how long do I boil spaghetti")
    hit = store.add_message(target.id, "assistant", "About nine minutes, until al dente.")
    elsewhere = store.create_session(title="Elsewhere")
    store.add_message(elsewhere.id, "user", "unrelated")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        assert screen.open_id == elsewhere.id
        await pilot.press("ctrl+f")
        await wait_for(pilot, lambda: isinstance(app.screen, SearchDialog))
        await pilot.press(*"dente")
        await wait_for(pilot, lambda: app.screen.hits)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.open_id == target.id)
        await pilot.pause()
        assert app.focused is screen.messages.find(hit.id)


async def test_export_writes_markdown_and_says_where(make_app, store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    session = store.create_session(title="Export me")
    store.add_message(session.id, "user", "hello")
    store.add_message(session.id, "assistant", "```python\nprint('hi')\n```")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await main_screen(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        await pilot.press("enter")
        path = tmp_path / f"export-me-{session.id}.md"
        await wait_for(pilot, path.exists)
        assert "## Assistant" in path.read_text() and "print('hi')" in path.read_text()
        assert any(str(path) in n.message for n in app._notifications)


async def test_copy_message_and_code_block(make_app, store):
    session = store.create_session(title="Code")
    store.add_message(session.id, "user", "code please")
    store.add_message(session.id, "assistant", "Here:\n\n```python\nx = 1\n```\n\nand\n\n```sh\nls\n```")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        screen.messages.bubbles[-1].focus()
        await pilot.press("b")
        assert app.clipboard == "x = 1\n"
        await pilot.press("b")
        assert app.clipboard == "ls\n"
        await pilot.press("c")
        assert app.clipboard.startswith("Here:")


async def test_rename(make_app, store):
    session = store.create_session(title="Old")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("Input").value = "New name"
        await pilot.press("enter")
        await wait_for(pilot, lambda: store.get_session(session.id).title == "New name")
        assert screen.sidebar.entries[0].title == "New name"


async def test_quit_stops_replies_and_shuts_the_engine_down(make_app, engine, store):
    engine.hold_at, engine.replies = 5, {"long": LONG}
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "long")
        chat = screen.current
        await wait_for(pilot, lambda: chat.reply)
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: engine.shut_down)
    assert stored(store, chat.session.id)[-1][2] == "partial"


async def test_command_palette_lists_the_chat_actions(make_app):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        titles = {c.title for c in app.get_system_commands(screen)}
        assert {"New chat", "Stop", "Regenerate", "Search", "Export to Markdown", "Delete chat", "KV map"} <= titles
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"KV map")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.query_one("#kv-map").display)


async def test_loading_progress_then_a_clear_error():
    shown: list[str] = []

    def factory(progress):
        progress("Converting model.gguf to safetensors (one time only)", 0.25)
        raise ModelNotFoundError("No model at /nope. Pass --model with a local HF folder or .gguf file.")

    app = LocalpagedApp(engine_factory=factory, store=None)
    async with app.run_test(size=(120, 40)) as pilot:
        shown.append(await error_message(pilot))
    assert shown == ["No model at /nope. Pass --model with a local HF folder or .gguf file."]


async def test_loading_screen_shows_progress():
    import threading

    release = threading.Event()

    def factory(progress):
        progress("Loading weights", 0.5)
        release.wait(5)
        raise ModelNotFoundError("stop here")

    app = LocalpagedApp(engine_factory=factory)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(
            pilot,
            lambda: (
                isinstance(app.screen, LoadingScreen)
                and str(app.screen.query_one("#loading-message").content) == "Loading weights"
            ),
        )
        assert app.screen.query_one("ProgressBar").percentage == 0.5
        release.set()
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))


async def test_an_unreadable_database_is_explained(engine, tmp_path):
    db = tmp_path / "chats.db"
    db.write_bytes(b"this is not an SQLite file" * 100)
    app = LocalpagedApp(engine_factory=lambda progress: engine, db=str(db))
    async with app.run_test(size=(120, 40)) as pilot:
        message = await error_message(pilot)
    assert str(db) in message and "not an SQLite file" in message
    assert db.read_bytes().startswith(b"this is not")  # left untouched


async def test_sending_while_the_chat_replies_keeps_the_text(make_app, engine):
    engine.hold_at = 2
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "first")
        await wait_for(pilot, lambda: screen.current and screen.current.reply)
        await send(pilot, "second")
        assert screen.query_one("#input").text == "second"
        engine.release()


async def test_a_message_that_was_never_stored_goes_back_in_the_box(make_app, engine, store):
    engine.info = dataclasses.replace(
        engine.info, max_model_len=40
    )  # less than the prompt itself: every turn is refused
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "a question that cannot fit")
        chat = screen.current
        await wait_for(pilot, lambda: screen.query_one("#input").text == "a question that cannot fit")
        assert not chat.generating and "too long" in chat.error
        assert any(n.title == "Reply failed" for n in app._notifications)
        assert stored(store, chat.session.id) == []
        assert screen.messages.bubbles == []


def test_a_closed_terminal_is_noticed() -> None:
    """The app quits once its terminal hangs up (tmux killed under `make chat`), instead of spinning on."""
    import os

    from localpaged.tui.app import terminal_gone

    controller, terminal = os.openpty()
    try:
        assert not terminal_gone(terminal)
        os.close(controller)
        assert terminal_gone(terminal)
    finally:
        os.close(terminal)


async def test_a_bad_prompt_file_is_reported_and_the_rest_are_offered(make_app, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    (tmp_path / "prompts" / "broken.md").mkdir(parents=True)  # not a regular file: skipped, and said so
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await main_screen(pilot)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: isinstance(app.screen, NewChatDialog))
        messages = [n.message for n in app._notifications]
        assert any("broken.md" in m and "not a regular file" in m for m in messages)
        options = app.screen.query_one("OptionList")
        offered = [str(options.get_option_at_index(i).prompt).lower() for i in range(options.option_count)]
        assert any("coding" in option for option in offered)  # the shipped prompts are still there
