"""Tools in the app, through Pilot: the test MCP server (tests/mcp_test_server.py) started with the app, a
call shown and approved or denied, its result folded under it, the reply going on; a server that dies at
start is one notice; a chat reopened after a restart shows (and replays) its stored calls."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
from fake_engine import FAKE_INFO, FakeEngine
from pilot_helpers import NOW, main_screen, new_chat, reply_done, send, wait_for
from textual.widgets import Button, Collapsible, Label, SelectionList

from localpaged.config_file import McpServerConfig, Settings
from localpaged.engine.protocol import EngineCapabilities
from localpaged.tui.app import LocalpagedApp
from localpaged.tui.screens.chat_settings import ChatSettingsDialog
from localpaged.tui.screens.tool_approval import ToolApprovalDialog
from localpaged.tui.screens.tools import ToolsDialog
from localpaged.tui.widgets.tool_call import ToolCallBlock

SERVER = str(Path(__file__).resolve().parent.parent / "mcp_test_server.py")
pytestmark = pytest.mark.anyio


def calls_answer(text: str) -> str:
    """The fake model: asks the answer tool, then answers from its result."""
    if text.startswith('{"tool_response"'):
        result = json.loads(text)["tool_response"]["content"]
        return json.dumps({"response": f"The tool says: {result}"})
    return json.dumps({"tool_call": {"name": "answer", "arguments": {"question": text}}})


def settings(*extra: str) -> Settings:
    servers = {"test": McpServerConfig("test", sys.executable, (SERVER,))}
    if "dead" in extra:
        servers["dead"] = McpServerConfig("dead", sys.executable, (SERVER, "--die"))
    return Settings(mcp_servers=MappingProxyType(servers))


def make(store, engine: FakeEngine, *extra: str) -> LocalpagedApp:
    return LocalpagedApp(
        engine_factory=lambda progress: engine, store=store, clock=lambda: NOW, settings=settings(*extra)
    )


async def tool_chat(pilot):
    screen = await main_screen(pilot)
    await wait_for(pilot, lambda: pilot.app.mcp.wait(0), timeout=60)
    await new_chat(pilot, screen)
    screen.current.session.set_tools(["test/answer"])
    screen.show_title()
    return screen


async def test_a_call_is_shown_approved_and_its_result_folded_under_it(store) -> None:
    engine = FakeEngine(default=calls_answer)
    app = make(store, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await tool_chat(pilot)
        assert "tools answer" in str(screen.query_one("#chat-title").content)
        await send(pilot, "life")
        await wait_for(pilot, lambda: isinstance(app.screen, ToolApprovalDialog))
        assert "answer" in str(app.screen.query_one(".dialog-title").content)
        await pilot.press("y")
        await reply_done(pilot, screen, screen.current)
        [block] = screen.messages.query(ToolCallBlock)
        assert block.call["function"]["name"] == "answer"
        assert block.query_one(Collapsible).title == "result" and block.query_one(Collapsible).collapsed
        assert block.result.content == "The answer to 'life' is 42."
        assert screen.messages.bubbles[-1].text == "The tool says: The answer to 'life' is 42."


async def test_a_denied_call_is_shown_as_denied_and_the_reply_goes_on(store) -> None:
    engine = FakeEngine(default=calls_answer)
    app = make(store, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await tool_chat(pilot)
        await send(pilot, "life")
        await wait_for(pilot, lambda: isinstance(app.screen, ToolApprovalDialog))
        await pilot.click("#tool-deny")
        await reply_done(pilot, screen, screen.current)
        [block] = screen.messages.query(ToolCallBlock)
        assert block.query_one(Collapsible).title == "denied"
        assert screen.messages.bubbles[-1].text.startswith("The tool says: The user did not allow")


async def test_a_server_dead_at_start_is_one_notice_and_the_app_works(store) -> None:
    engine = FakeEngine()
    app = make(store, engine, "dead")
    told: list[
        str
    ] = []  # every notice, kept: a shown one expires after its timeout, on a slow machine before it is read
    shown = app.notify
    app.notify = lambda message, **options: (told.append(message), shown(message, **options))[1]
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await wait_for(pilot, lambda: app.mcp.wait(0), timeout=60)
        await wait_for(pilot, lambda: app._mcp_told)
        notices = [message for message in told if "MCP server" in message]
        assert len(notices) == 1 and "'dead'" in notices[0] and "broken on purpose" in notices[0]
        await new_chat(pilot, screen)
        await send(pilot, "hello")
        await reply_done(pilot, screen, screen.current)
        assert screen.messages.bubbles[-1].text == "You said: **hello**."
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ToolsDialog))
        report = str(app.screen.query_one(".tools-report Static").content)
        assert "answer  [test/answer]" in report and "dead" in report and "failed" in report


async def test_a_restart_shows_and_replays_the_stored_calls(store) -> None:
    engine = FakeEngine(default=calls_answer)
    async with make(store, engine).run_test(size=(120, 40)) as pilot:
        screen = await tool_chat(pilot)
        await send(pilot, "life")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ToolApprovalDialog))
        await pilot.press("a")  # allowed for this chat: the next call asks nothing
        await reply_done(pilot, screen, screen.current)
        session_id = screen.current.session.id
    again = FakeEngine(default=calls_answer)
    app = LocalpagedApp(
        engine_factory=lambda progress: again,
        store=store,
        clock=lambda: NOW,
        settings=settings(),
        session_id=session_id,
    )
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await wait_for(pilot, lambda: screen.messages.query(ToolCallBlock))
        await wait_for(pilot, lambda: app.mcp.wait(0), timeout=60)
        await send(pilot, "more")
        await reply_done(pilot, screen, screen.current)
        assert len(screen.messages.query(ToolCallBlock)) == 2  # asked nothing: allowed for the chat
        replayed = again.decode(again.prompts[0])
        assert '"tool_response"' in replayed and "The answer to 'life' is 42." in replayed


async def test_an_engine_that_refuses_tools_shows_why_instead_of_the_picker(store) -> None:
    engine = FakeEngine()
    refuses = EngineCapabilities(
        False, False, False, False, tools=False, notes={"tools": "it refuses JSON-schema replies"}
    )
    engine.info = dataclasses.replace(FAKE_INFO, capabilities=refuses)
    async with make(store, engine).run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await new_chat(pilot, screen)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ToolsDialog))
        hint = str(pilot.app.screen.query_one(".dialog-hint", Label).content)
        assert hint == "Tools are off on this engine: it refuses JSON-schema replies."
        assert not pilot.app.screen.query(SelectionList) and not pilot.app.screen.query("#tools-save")


async def test_the_chat_settings_dialog_opens_the_chats_tool_picker(store) -> None:
    async with make(store, FakeEngine()).run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await wait_for(pilot, lambda: pilot.app.mcp.wait(0), timeout=60)
        await new_chat(pilot, screen)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatSettingsDialog))
        pilot.app.screen.query_one("#settings-tools", Button).press()  # the dialog scrolls: below the fold
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ToolsDialog))
        pilot.app.screen.query_one(SelectionList).select("test/answer")
        pilot.app.screen.query_one("#tools-save", Button).press()
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatSettingsDialog))
        assert screen.current.session.tools_chosen == ["test/answer"]
        await pilot.press("escape")
        await wait_for(pilot, lambda: pilot.app.screen is screen)
        assert screen.current.session.tools_chosen == ["test/answer"]
