"""A chat's generation, owned by the session rather than by whatever widget shows it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any, Literal

from textual.app import App
from textual.message import Message
from textual.message_pump import MessagePump
from textual.worker import Worker

from localpaged.errors import EngineDeadError, LocalpagedError, RemoteEngineError
from localpaged.tui.widgets.status_line import ChatFigures

Phase = Literal["start", "first", "done"]  # "first": the first text arrived (the chat has its title)


class ReplyActivity(Message):
    """A chat started a reply, got its first text, or finished (posted for every chat, shown or not).

    Growth in between posts nothing: the screen pulls the open chat's `reply` at most every
    REDRAW_S, so the cost of drawing does not grow with tokens per second, and a chat that is
    not on screen costs no drawing at all.
    """

    def __init__(self, chat: LiveChat, phase: Phase) -> None:
        super().__init__()
        self.chat = chat
        self.phase = phase


class EngineDied(Message):
    """`engine` is gone for good (its core process died), or its remote server cannot be reached;
    the app offers to start a new one (for a remote engine: to connect again).

    Posted by a chat whose reply failed with EngineDeadError or RemoteEngineError, and by the figures
    refresh. It bubbles from the chat screen to the app, which shows one screen for any number of these.
    """

    def __init__(self, engine: Any, error: EngineDeadError | RemoteEngineError) -> None:
        super().__init__()
        self.engine = engine
        self.error = error
        self.remote = isinstance(error, RemoteEngineError)


class LiveChat:
    """One session and the reply it is generating.

    The generation runs as an app-level worker and accumulates its text here, so a chat keeps
    growing while another one is on screen; the screen asks for `reply` when it shows the chat
    again. `before` is what the chat held when the reply started (plus the user's new message),
    so the screen can draw a chat mid-reply without relying on how the session stores partials.
    When the engine is restarted the screen hands `session` the new one; a reply that dies with
    the old one reports that engine (`EngineDied`), so a late report is known as old news.
    """

    def __init__(self, session: Any, app: App, target: MessagePump) -> None:
        self.session = session
        self.app = app
        self.target = target
        self.reply = ""
        self.error: str | None = None
        self.failure: Exception | None = None  # what `error` says, as raised
        self.unsent: str | None = None  # the user's text when the reply failed before it was stored
        self.stopped = False
        self.before: list[tuple[str, str]] = []
        self.worker: Worker[None] | None = None
        self._running = False
        self.context_tokens = 0  # refreshed off the UI thread: counting takes the engine lock
        self.stored_figures: tuple[float | None, float | None] = (None, None)  # of the last stored reply
        self._started = 0.0
        self._first: float | None = None
        self._chunks = 0
        self._text: str | None = None
        self._engine: Any = None  # the engine of the reply in flight (the session's may be replaced)

    @property
    def generating(self) -> bool:
        return self._running

    def visible_history(self) -> list[Any]:
        """The stored messages a user sees (the system prompt is shown in the title bar)."""
        return [m for m in self.session.history if m.role != "system"]

    def engine_messages(self) -> list[dict]:
        """The stored chat as the model reads it: the very messages the session's next prompt starts from."""
        return self.session.engine_messages()

    def send(self, text: str) -> None:
        """Store `text` as the user's message and stream the reply; with the chat's tools (those of its
        choice that a running MCP server has), a turn of rounds whose calls the user approves."""
        self.before = [(m.role, m.content) for m in self.visible_history() if m.role != "tool"] + [("user", text)]
        chosen = set(self.session.tools_chosen)
        mcp = getattr(self.app, "mcp", None)
        tools = [t for t in mcp.tools() if t.key in chosen] if chosen and mcp is not None else []
        if tools:
            self._run(self._tool_text(self.session.astream_events(text, tools=tools, approve=self._approve)), text)
        else:
            self._run(self.session.astream(text), text)

    async def _tool_text(self, events: AsyncIterator[Any]) -> AsyncIterator[str]:
        """The text of a turn with tools; its calls and results are drawn from the store when it ends."""
        from localpaged.chat.tool_turn import TextDelta

        async for event in events:
            if isinstance(event, TextDelta):
                yield event.text

    async def _approve(self, call: Any, tool: Any) -> str:
        """Ask the user about a call (a dialog over whatever is on screen); escape denies and stops the turn."""
        from localpaged.tui.screens.tool_approval import ToolApprovalDialog

        answer = await self.app.push_screen_wait(ToolApprovalDialog(call.name, tool.source, call.arguments))
        if answer == "stop":
            await self.stop()
            return "deny"
        return answer

    def regenerate(self) -> None:
        """Replace the last reply with a fresh one."""
        shown = [(m.role, m.content) for m in self.visible_history()]
        while shown and shown[-1][0] == "assistant":
            shown.pop()
        self.before = shown
        self._run(self.session.aregenerate(), None)

    def continue_reply(self, so_far: str) -> None:
        """Let the last reply (which says `so_far`) go on where it stopped, in the same message."""
        shown = [(m.role, m.content) for m in self.visible_history()]
        if shown and shown[-1][0] == "assistant":
            shown.pop()
        self.before = shown
        self._run(self.session.acontinue_reply(), None, so_far)

    async def stop(self) -> None:
        """Stop generating; the partial reply stays in the chat, marked as such."""
        if self.generating:
            self.stopped = True
            try:
                await self.session.stop()
            except EngineDeadError:
                pass  # nothing left to stop: the reply ends with that error on its own

    def figures(self) -> ChatFigures:
        """Live tok/s and time to first token while generating, the engine's figures after.

        The context is everything the model sees: while a reply streams, the session's count of its
        whole prompt (system prompt, history, the new message) plus the tokens generated so far; until
        the session has built that prompt, the last count of the stored chat.
        """
        engine = self.session.engine
        max_len = engine.info.max_model_len  # None: a remote server that does not say
        counted = self.context_tokens if engine.info.capabilities.tokenize else None  # None: nothing counts here
        if self.generating:
            now = time.monotonic()
            ttft = None if self._first is None else self._first - self._started
            rate = None if self._first is None or now <= self._first else self._chunks / (now - self._first)
            live = self.session.live_context_tokens
            return ChatFigures(rate, ttft, counted if live is None else live, max_len)
        metrics = self.session.last_metrics
        if metrics is None:  # reopened from the store: show what its last reply achieved
            return ChatFigures(*self.stored_figures, counted, max_len)
        return ChatFigures(metrics.decode_tokens_per_s, metrics.ttft_s, counted, max_len, metrics.disk_tokens > 0)

    def _run(self, deltas: AsyncIterator[str], text: str | None, so_far: str = "") -> None:
        self.reply, self.error, self.failure, self.unsent, self.stopped = so_far, None, None, None, False
        self._started, self._first, self._chunks = time.monotonic(), None, 0
        self._text, self._engine = text, self.session.engine
        self._running = True
        self.worker = self.app.run_worker(
            self._consume(deltas), name=f"reply-{self.session.id}", group="replies", exit_on_error=False
        )

    async def _consume(self, deltas: AsyncIterator[str]) -> None:
        self.target.post_message(ReplyActivity(self, "start"))
        try:
            async for delta in deltas:
                self._chunks += 1  # live tok/s counts what arrived, however seldom it is drawn
                self.reply += delta
                if self._first is None:
                    self._first = time.monotonic()
                    self.target.post_message(ReplyActivity(self, "first"))
        except Exception as err:  # noqa: BLE001 -- shown to the user; the app must outlive a failed request
            self.error, self.failure = str(err) or type(err).__name__, err
            if isinstance(err, (EngineDeadError, RemoteEngineError)):
                self.target.post_message(EngineDied(self._engine, err))
            with suppress(LocalpagedError):  # failed before the session stored the text: give it back
                if self._text is not None and len(self.visible_history()) < len(self.before):
                    self.unsent = self._text
        finally:
            self._running = False
            self.target.post_message(ReplyActivity(self, "done"))
