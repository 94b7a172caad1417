"""Pilot tests of how a growing reply is drawn: at most every REDRAW_S, never while off screen."""

from __future__ import annotations

import time

import pytest
from pilot_helpers import main_screen, new_chat, reply_done, send, wait_for
from textual.widgets import Markdown

from localpaged.tui.screens.main import REDRAW_S
from localpaged.tui.widgets.bubble import MessageBubble

pytestmark = pytest.mark.anyio

WORDS = 600
FAST = " ".join(f"w{i}" for i in range(WORDS))


@pytest.fixture
def redraws(monkeypatch) -> list[float]:
    """When each bubble redraw that added text happened."""
    times: list[float] = []
    grow = MessageBubble.grow

    async def counted(bubble: MessageBubble, text: str) -> None:
        if len(text) > bubble.shown:
            times.append(time.monotonic())
        await grow(bubble, text)

    monkeypatch.setattr(MessageBubble, "grow", counted)
    return times


async def test_a_fast_reply_is_redrawn_at_most_every_redraw_s_and_ends_in_full(make_app, engine, redraws):
    engine.delay, engine.hold_at, engine.replies = 0.001, 1, {"fast": FAST}
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        started = time.monotonic()
        await send(pilot, "fast")
        chat = screen.current
        # The first word is drawn at once (the "first" phase), without waiting for more.
        await wait_for(pilot, lambda: screen.live_bubble is not None and screen.live_bubble.text == "w0")
        assert chat.generating and len(redraws) == 1
        engine.release()
        await reply_done(pilot, screen, chat)
        elapsed = time.monotonic() - started
        assert len(redraws) <= elapsed / REDRAW_S + 3, (len(redraws), elapsed)
        assert len(redraws) >= 2  # it did grow on screen while streaming, not only at the end
        bubble = screen.messages.bubbles[-1]
        assert bubble.text == FAST and bubble.query_one(Markdown).source == FAST
        assert bubble.status == "complete"
        assert chat.session.last_metrics.generated_tokens == WORDS


async def test_a_chat_off_screen_costs_no_drawing(make_app, engine, store, redraws):
    engine.delay, engine.hold_at, engine.replies = 0.001, 1, {"go": FAST}
    other = store.create_session(title="Other")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await new_chat(pilot, screen)
        await send(pilot, "go")
        chat = screen.current
        await wait_for(pilot, lambda: chat.reply)
        await pilot.press("ctrl+down")
        assert screen.open_id == other.id and screen.live_bubble is None
        redraws.clear()
        engine.hold_at = WORDS // 2
        await wait_for(pilot, lambda: len(chat.reply) > len(FAST) // 3)  # grows while hidden
        assert redraws == []
        await pilot.press("ctrl+up")
        assert screen.current is chat and len(screen.live_bubble.text) > len(FAST) // 3  # all it got while hidden
        engine.release()
        await reply_done(pilot, screen, chat)
        assert screen.messages.bubbles[-1].text == FAST


async def test_the_footer_is_rebuilt_only_when_what_it_shows_changes(make_app, engine, monkeypatch):
    """Start (stop offered) and end (stop gone) change the footer; the first text of a reply does not."""
    from textual.widgets import Footer

    rebuilds: list[bool] = []
    recompose = Footer.recompose

    async def counted(footer: Footer) -> None:
        rebuilds.append(footer.screen.check_action("stop", ()))
        await recompose(footer)

    monkeypatch.setattr(Footer, "recompose", counted)
    engine.delay, engine.hold_at, engine.replies = 0.001, 1, {"go": FAST}
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "go")
        chat = screen.current
        await wait_for(pilot, lambda: screen.live_bubble is not None and screen.live_bubble.text == "w0")
        await pilot.pause()
        rebuilds.clear()  # the reply has started and shown its first text: stop is offered
        assert screen.check_action("stop", ())
        screen.refresh_bindings_if_changed()
        await pilot.pause()
        assert rebuilds == []  # nothing the footer shows changed
        engine.release()
        await reply_done(pilot, screen, chat)
        await pilot.pause()
        assert rebuilds and rebuilds[-1] is None  # the end dimmed stop, and the footer shows it
