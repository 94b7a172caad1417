"""The app on a RemoteEngine: our server (tiny model, on a thread) as the remote, reached only over HTTP."""

from __future__ import annotations

import pytest
from pilot_helpers import engine_dead_message, error_message, main_screen, new_chat, reply_done, send, wait_for

from localpaged.chat.store import ChatStore
from localpaged.config_file import Settings
from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.remote import RemoteEngine
from localpaged.tui.app import LocalpagedApp
from localpaged.tui.screens.engine_dead import EngineDeadScreen
from localpaged.tui.widgets.kv_map import KVMapPanel
from tests.server.running import running_server
from tests.support import free_port

pytestmark = pytest.mark.anyio
SHORT = Settings().with_flags({"sampling.max_tokens": 10, "sampling.temperature": 0.0})


@pytest.fixture(scope="module")
def server(tiny_model_path):
    engine = AsyncLLM(str(tiny_model_path), engine_process=False, device="cpu", dtype="float32", max_model_len=1024)
    with running_server(engine) as url:
        yield f"{url}/v1"
    engine.shutdown()


async def test_two_chats_on_a_remote_engine(server, tmp_path):
    remote = RemoteEngine(server)
    store = ChatStore(tmp_path / "chats.db")
    app = LocalpagedApp(engine_factory=lambda progress: remote, store=store, settings=SHORT)
    async with app.run_test(size=(150, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "Hello over HTTP")
        first = screen.current
        await new_chat(pilot, screen)
        await send(pilot, "A second chat")
        second = screen.current
        await reply_done(pilot, screen, first, second)
        for chat, text in ((first, "Hello over HTTP"), (second, "A second chat")):
            user, reply = store.messages(chat.session.id)
            assert user.content == text and reply.status == "complete" and reply.content == chat.reply
            assert reply.completion_tokens == 10 and reply.prompt_tokens  # the server's usage
        status = screen.query_one("#status")
        await wait_for(pilot, lambda: "remote engine" in str(status.content))
        shown = str(status.content)
        assert f"on remote engine {server}" in shown and "KV pool on the server" in shown
        assert "of 1024 tokens" in shown and "prefix cache on the server" in shown  # not zeros
        await pilot.press("ctrl+g")
        grid = screen.query_one(KVMapPanel).query_one("#kv-grid")
        await wait_for(pilot, lambda: "not visible" in str(grid.content))
        await pilot.press("ctrl+q")
    store.close()


async def test_an_unreachable_server_is_an_error_screen_with_its_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    app = LocalpagedApp(backend=url, store=ChatStore(":memory:"))
    async with app.run_test() as pilot:
        assert await error_message(pilot) == f"cannot reach {url}: connection refused"


async def test_losing_the_server_mid_chat_offers_to_connect_again(tiny_model_path, tmp_path):
    engine = AsyncLLM(str(tiny_model_path), engine_process=False, device="cpu", dtype="float32", max_model_len=1024)
    store = ChatStore(tmp_path / "chats.db")
    with running_server(engine) as url:
        remote = RemoteEngine(f"{url}/v1")
    engine.shutdown()  # the server is gone: the next request finds nobody listening
    app = LocalpagedApp(engine_factory=lambda progress: remote, store=store, settings=SHORT)
    async with app.run_test(size=(150, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "Anyone there?")
        assert await engine_dead_message(pilot) == f"cannot reach {url}/v1: connection refused"
        assert str(app.screen.query_one("#engine-dead-title").content) == "The remote engine cannot be reached"
        assert isinstance(app.screen, EngineDeadScreen) and screen.current is not None
        footer = {b.binding.description for b in app.screen.active_bindings.values()}
        assert "Connect again" in footer and "Restart engine" not in footer  # the button's name, in the footer too
        # Counting the prompt (the server's /tokenize) failed before the message was stored: it is
        # given back to the input box, to send again once the server is back.
        assert store.messages(screen.current.session.id) == []
        await wait_for(pilot, lambda: screen.query_one("#input").text == "Anyone there?")
        await pilot.press("q")
    store.close()
