"""The app and the disk KV tier: a reopened chat's blocks are prefetched, and a reply that read them says so."""

from __future__ import annotations

import pytest
from pilot_helpers import main_screen, reply_done, send, wait_for

from localpaged.tui.widgets.status_line import StatusLine

pytestmark = pytest.mark.anyio


def status_text(screen) -> str:
    return str(screen.query_one(StatusLine).render())


async def test_a_reopened_chat_is_prefetched_and_its_reply_shows_from_disk(make_app, engine, store) -> None:
    session = store.create_session(system="Be brief.")
    store.add_message(session.id, "user", "hello")
    store.add_message(session.id, "assistant", "Hi there.")
    engine.disk_tokens = 32
    app = make_app(session_id=session.id)
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await main_screen(pilot)
        await wait_for(pilot, lambda: engine.prefetched)
        assert engine.prefetched == [
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hi there."},
            ]
        ]
        assert "from disk" not in status_text(screen)
        await send(pilot, "and now?")
        await reply_done(pilot, screen, screen.current)
        screen.refresh_figures()
        await wait_for(pilot, lambda: "from disk" in status_text(screen))


async def test_a_new_chat_is_not_prefetched_and_shows_no_disk(make_app, engine, store) -> None:
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "hello")
        await reply_done(pilot, screen, screen.current)
        screen.refresh_figures()
        await wait_for(pilot, lambda: "first token" in status_text(screen))
        assert "from disk" not in status_text(screen) and engine.prefetched == []
