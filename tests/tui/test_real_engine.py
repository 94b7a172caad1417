"""End to end on the real engine (tiny random Llama on the CPU): stream, finish, KV map, quit."""

from __future__ import annotations

import pytest
from pilot_helpers import main_screen, send, wait_for

from localpaged.chat.store import ChatStore
from localpaged.tui.app import LocalpagedApp
from localpaged.tui.widgets.kv_map import KVMapPanel

pytestmark = pytest.mark.anyio


async def test_chat_on_the_tiny_engine(tiny_llm, tmp_path):
    from localpaged.engine.async_llm import AsyncLLM

    engine = AsyncLLM(llm=tiny_llm())
    store = ChatStore(tmp_path / "chats.db")
    app = LocalpagedApp(engine_factory=lambda progress: engine, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "Hello there")
        chat = screen.current
        await wait_for(pilot, lambda: chat.reply, timeout=60)
        await wait_for(pilot, lambda: not chat.generating, timeout=120)
        await pilot.pause(0.2)
        reply = store.messages(chat.session.id)[-1]
        assert reply.role == "assistant" and reply.status == "complete" and reply.content
        assert screen.messages.bubbles[-1].text == reply.content == chat.reply
        await pilot.press("ctrl+g")
        panel = screen.query_one(KVMapPanel)
        await wait_for(pilot, lambda: "blocks" in str(panel.query_one("#kv-figures").content), timeout=10)
        figures = str(panel.query_one("#kv-figures").content)
        assert "this chat 0 blocks" not in figures  # the finished turn's prefix is cached and highlighted
        assert engine.info.model_name in str(screen.query_one("#status").content)
        await pilot.press("ctrl+q")
    with pytest.raises(Exception, match="shut down"):
        async for _ in engine.stream("x"):
            pass
