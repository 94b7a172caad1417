"""The chat screen: sidebar of chats, the open chat, input, status line and KV map."""

from __future__ import annotations

from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Footer, Label

from localpaged.chat.session import CHAT_SETTINGS, Session, settings_summary
from localpaged.config_file import Settings
from localpaged.engine.output import KVMap
from localpaged.engine.protocol import EngineClient, EngineStats
from localpaged.errors import EngineDeadError, LocalpagedError, RemoteEngineError
from localpaged.tui.actions import ChatActions
from localpaged.tui.live import EngineDied, LiveChat, ReplyActivity
from localpaged.tui.redraw_pacer import REDRAW_S, RedrawPacer
from localpaged.tui.screens.chat_settings import ChatSettingsChoice, ChatSettingsDialog
from localpaged.tui.screens.tools import ToolsDialog
from localpaged.tui.widgets.bubble import MessageBubble, metrics_note
from localpaged.tui.widgets.chat_input import ChatInput
from localpaged.tui.widgets.kv_map import KVMapPanel
from localpaged.tui.widgets.message_list import MessageList
from localpaged.tui.widgets.sidebar import SessionEntry, SessionList
from localpaged.tui.widgets.status_line import StatusLine
from localpaged.tui.widgets.tool_call import ToolCallBlock

REFRESH_S = 0.5  # status line and KV map


class MainScreen(ChatActions):
    """Coordinates the widgets; every generation lives in a `LiveChat`, never in a widget."""

    BINDINGS = [
        Binding("ctrl+n", "new_chat", "New chat", id="new_chat"),
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
        # Not ctrl+e: in the input box that moves to the end of the line.
        Binding("ctrl+t", "continue", "Continue", id="continue"),
        Binding("ctrl+f", "search", "Search", id="search"),
        Binding("ctrl+g", "toggle_kv_map", "KV map", id="kv_map"),
        Binding("ctrl+s", "export", "Export to Markdown", id="export", show=False),
        Binding("ctrl+o", "chat_settings", "Chat settings", id="chat_settings", show=False),
        Binding("f3", "chat_tools", "This chat's tools", id="chat_tools", show=False),
        Binding("f4", "mcp_tools", "MCP servers and tools", id="mcp_tools", show=False),
        Binding("f2", "rename", "Rename chat", id="rename", show=False),
        Binding("f8", "delete", "Delete chat", id="delete", show=False),
        Binding("ctrl+up", "next_chat(-1)", "Previous chat", id="previous_chat", show=False),
        Binding("ctrl+down", "next_chat(1)", "Next chat", id="next_chat", show=False),
        *(Binding(f"alt+{n}", f"open_nth({n - 1})", f"Chat {n}", id=f"chat_{n}", show=False) for n in range(1, 10)),
    ]

    def __init__(
        self,
        engine: EngineClient,
        store: Any,
        clock: Any,
        open_id: str | None = None,
        *,
        settings: Settings | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings if settings is not None else Settings()
        self.engine = engine
        self.store = store
        self.clock = clock
        self.chats: dict[str, LiveChat] = {}
        self.open_id: str | None = None
        self.live_bubble: MessageBubble | None = None
        self.engine_lost = False  # the engine died: no figures until the app hands over a new one
        self._first_open = open_id
        self._redraw: Timer  # made on mount; ticks every REDRAW_S while the open chat's reply grows
        self._pacer = RedrawPacer()  # which ticks redraw
        self._redraw_due = False
        self._bindings_shown: tuple = ()  # what the footer was last told (refresh_bindings_if_changed)
        self._last_encoded: tuple[object, list[int]] = (None, [])  # the latest chat counted, and its ids

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield SessionList(id="sidebar")
            with Vertical(id="chat-pane"):
                yield Label(id="chat-title", markup=False)
                yield MessageList(id="messages")
                yield ChatInput(id="input")
            yield KVMapPanel(id="kv-map")
        yield StatusLine(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        self._redraw = self.set_interval(REDRAW_S, self._queue_redraw, pause=True)
        self.refresh_sidebar()
        first = self._first_open or next(iter(e.id for e in self.sidebar.entries), None)
        if first is not None:
            await self.open(first)
        else:
            self.show_title()
        self.query_one(ChatInput).focus()
        self._refresh = self.set_interval(REFRESH_S, self.refresh_figures)
        self.refresh_figures()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Stop only while the open chat generates, regenerate only while it does not (else dimmed);
        continue only when the open chat's last reply stopped at a token limit (else hidden)."""
        chat = self.current
        if action == "stop":
            return True if chat is not None and chat.generating else None
        if action == "regenerate":
            return True if chat is not None and not chat.generating else None
        if action == "continue":
            if chat is None or chat.generating:
                return False
            if self._continuable(chat):
                return True
            # A reply cut off on an engine that cannot continue: shown, dimmed; the action says why.
            return None if not self.engine.info.capabilities.continue_reply and self._cut_off(chat) else False
        return True

    def _cut_off(self, chat: LiveChat) -> bool:
        history = chat.visible_history()
        return bool(history) and history[-1].role == "assistant" and history[-1].finish_reason == "length"

    def _continuable(self, chat: LiveChat) -> bool:
        try:
            return chat.session.continuable() is not None
        except LocalpagedError:  # the store is closing (quit) or locked: nothing to continue now
            return False

    # ----- helpers ------------------------------------------------------------------

    @property
    def sidebar(self) -> SessionList:
        return self.query_one(SessionList)

    @property
    def messages(self) -> MessageList:
        return self.query_one(MessageList)

    @property
    def current(self) -> LiveChat | None:
        return self.chats.get(self.open_id) if self.open_id else None

    def chat(self, session_id: str) -> LiveChat:
        """The live chat of a session, loaded from the store on first use."""
        if session_id not in self.chats:
            self.prefetch_kv(self.adopt(Session.load(self.engine, self.store, session_id)))
        return self.chats[session_id]

    @work(thread=True, group="prefetch")
    def prefetch_kv(self, chat: LiveChat) -> None:
        """Have the engine load a reopened chat's KV blocks from its disk tier while the user reads and types."""
        if chat.session.history:
            try:
                self.engine.prefetch(chat.engine_messages())
            except LocalpagedError:
                pass  # only a head start was lost: the reply computes what it needs

    def adopt(self, session: Session) -> LiveChat:
        """Take a session into the app: its replies sample and stop as the settings say."""
        session.sampling = self.settings.sampling.template()
        session.max_tokens = self.settings.sampling.max_tokens
        self.chats[session.id] = LiveChat(session, self.app, self)
        return self.chats[session.id]

    def refresh_sidebar(self) -> None:
        """Re-read titles and activity times; newest first, live chats marked."""
        entries = [
            SessionEntry(r.id, r.title or "", r.updated, r.id in self.chats and self.chats[r.id].generating)
            for r in self.store.list_sessions()
        ]
        self.sidebar.set_entries(entries, self.clock())
        if self.open_id:
            self.sidebar.select(self.open_id)

    def show_title(self) -> None:
        chat = self.current
        if chat is None:
            text = "New chat — type below to start, ctrl+n to pick a system prompt"
        else:
            prompt = chat.session.prompt_name or ("custom system prompt" if chat.session.system else "no system prompt")
            text = f"{chat.session.title or 'Untitled'}  ·  {prompt}"
            if own := settings_summary(chat.session.settings):
                text += f"  ·  {own}"
        self.query_one("#chat-title", Label).update(text)

    async def open(self, session_id: str) -> None:
        """Show a chat: its stored messages, and its reply so far if it is still generating."""
        chat = self.chat(session_id)
        self.open_id = session_id
        self.sidebar.select(session_id)
        self.show_title()
        if chat.generating:
            bubbles = [MessageBubble(role, text) for role, text in chat.before]
            self.live_bubble = MessageBubble("assistant", chat.reply, note="generating…")
            bubbles.append(self.live_bubble)
            self._resume_redraw()
        else:
            self.live_bubble = None
            bubbles = self._stored_bubbles(chat.visible_history())
        await self.messages.show(bubbles)
        self.refresh_bindings()
        self.refresh_figures()

    def _stored_bubbles(self, history: list) -> list:
        """A bubble per stored message; an assistant's tool calls as ToolCallBlocks, each with its result
        (the "tool" message answering it) folded under it."""
        results = {m.tool_call_id: m for m in history if m.role == "tool"}
        shown: list = []
        for m in history:
            if m.role == "tool":
                continue
            if m.content or not m.calls:
                note = metrics_note(m, self.engine.info.max_model_len)
                shown.append(MessageBubble(m.role, m.content, m.id, m.status, note))
            shown += [ToolCallBlock(call, results.get(call["id"])) for call in m.calls]
        return shown

    async def start_reply(self, chat: LiveChat, text: str | None, *, resume: str | None = None) -> bool:
        """Send `text` (or regenerate when None, or continue the last reply, which says `resume`) and,
        if the chat is open, show the reply growing."""
        if chat.generating:
            self.notify("This chat is still replying; press escape to stop it first.", severity="warning")
            return False
        if chat.session.id == self.open_id:
            if text is not None:
                await self.messages.add(MessageBubble("user", text))
            self.live_bubble = MessageBubble("assistant", resume or "", note="generating…")
            await self.messages.add(self.live_bubble)
        if resume is not None:
            chat.continue_reply(resume)
        elif text is not None:
            chat.send(text)
        else:
            chat.regenerate()
        return True

    # ----- reply activity -------------------------------------------------------------

    async def on_reply_activity(self, event: ReplyActivity) -> None:
        chat = event.chat
        shown = chat.session.id == self.open_id and self.live_bubble is not None
        if event.phase == "first" and shown:
            await self.live_bubble.grow(chat.reply)  # the first words at once, the rest every REDRAW_S
            self._resume_redraw()
        elif event.phase == "done":
            if chat.error and not isinstance(chat.failure, (EngineDeadError, RemoteEngineError)):  # their own screen
                self.notify(chat.error, title="Reply failed", severity="error", timeout=8)
            if shown:
                await self.finish_shown(chat)
            if chat.unsent and chat.session.id == self.open_id and not self.query_one(ChatInput).text:
                self.query_one(ChatInput).text = chat.unsent  # it was never stored: keep it for later
        self.show_title()  # a first message names the chat as its reply starts
        self.refresh_sidebar()
        self.refresh_bindings_if_changed()

    def _bindings_on_show(self) -> tuple:
        """What the footer shows: the bindings in reach, each enabled or not (and whether the app has focus)."""
        active = self.active_bindings.items()
        return self.app.app_focus, tuple((key, b.binding.action, b.binding.description, b.enabled) for key, b in active)

    def refresh_bindings(self) -> None:
        self._bindings_shown = self._bindings_on_show()
        super().refresh_bindings()

    def refresh_bindings_if_changed(self) -> None:
        """Tell the footer about the bindings only if what it shows would change.

        The footer rebuilds every key on each ``refresh_bindings``, and every reply's start, first text
        and end would ask for one while most change nothing the footer shows; each rebuild re-lays out
        the whole screen, CPU taken from the engine core on a machine of few cores.
        """
        if self._bindings_on_show() != self._bindings_shown:
            self.refresh_bindings()

    def _resume_redraw(self) -> None:
        self._pacer.restart()
        self._redraw.resume()

    def _queue_redraw(self) -> None:
        """Timer tick: draw in the screen's own message order, never two redraws queued."""
        if self._pacer.tick() and not self._redraw_due:
            self._redraw_due = True
            self.call_later(self.redraw_reply)

    async def redraw_reply(self) -> None:
        """Append to the open chat's bubble all the text its reply gained since the last redraw."""
        self._redraw_due = False
        chat = self.current
        if chat is None or not chat.generating or self.live_bubble is None:
            self._redraw.pause()  # nothing grows on screen: no ticks until a shown reply does
            return
        await self.live_bubble.grow(chat.reply)

    async def finish_shown(self, chat: LiveChat) -> None:
        """Render the finished reply in full and give the bubbles their stored ids."""
        history = chat.visible_history()
        bubbles = self.messages.bubbles
        reply = chat.session.last_reply
        if chat.error or reply is None or len(history) != len(bubbles):
            await self.open(chat.session.id)  # the turn did not go as drawn: redraw from the store
            return
        assert self.live_bubble is not None
        await self.live_bubble.finish(
            reply.content, reply.status, reply.id, metrics_note(reply, self.engine.info.max_model_len)
        )
        self.live_bubble = None
        for bubble, record in zip(bubbles, history):
            bubble.message_id, bubble.status = record.id, record.status

    # ----- figures (read off the UI thread: the engine lock is held during each step) --

    @work(thread=True, exclusive=True, group="figures")
    def refresh_figures(self) -> None:
        engine = self.engine  # one engine throughout, even if a restart swaps it meanwhile
        panels = self.query(KVMapPanel)
        if self.engine_lost or not panels:
            return  # no engine to ask, or the screen was taken down (quit) before this thread ran
        chat = self.current
        capabilities = engine.info.capabilities
        kv_visible = panels.first().display and capabilities.kv_pool  # a remote pool is not in view
        try:
            stats = engine.stats()
            tokens: list[int] | None = None
            if chat is not None:
                history = chat.visible_history()
                # While a reply streams the session counts its own context (LiveChat.figures), so the
                # whole chat is encoded here only for the KV map or for a chat at rest.
                if capabilities.tokenize and (kv_visible or not chat.generating):
                    tokens = self._encoded(engine, chat.engine_messages())
                    if not chat.generating:
                        chat.context_tokens = len(tokens)
                replies = [m for m in history if m.role == "assistant"]
                if replies:
                    chat.stored_figures = (replies[-1].tokens_per_s, replies[-1].ttft_s)
            kv_map = engine.kv_map(tokens) if kv_visible else None
        except EngineDeadError as err:
            self.post_message(EngineDied(engine, err))  # thread-safe; the app shows what happened
            return
        except LocalpagedError:
            return  # the engine was shut down meanwhile (quit): nothing left to show
        self.app.call_from_thread(self.show_figures, stats, kv_map)

    def _encoded(self, engine: EngineClient, messages: list[dict]) -> list[int]:
        """The chat's token ids, encoded again only when it changed: at rest a chat is the same every refresh,
        and a remote engine counts over HTTP."""
        key = (id(engine), repr(messages))
        if self._last_encoded[0] != key:
            self._last_encoded = (key, engine.encode_chat(messages) if messages else [])
        return self._last_encoded[1]

    def stop_refreshing(self) -> None:
        """No more figures: the engine is about to shut down (quit)."""
        self._refresh.stop()

    def show_figures(self, stats: EngineStats, kv_map: KVMap | None) -> None:
        status = self.query(StatusLine)
        if not status:
            return  # read on a thread, these arrived after the screen was taken down (quit): nowhere to show them
        chat = self.current
        figures = chat.figures() if chat else None
        pool = self.engine.info.capabilities.kv_pool
        status.first().show(self.engine.info.model_name, self.engine.info.device, stats, figures, pool=pool)
        if kv_map is not None:
            self.query_one(KVMapPanel).show(kv_map, stats)
        elif not pool:
            self.query_one(KVMapPanel).show_remote(self.engine.info.device)
        if chat is not None and chat.generating and self.live_bubble is not None and figures:
            rate = "–" if figures.tokens_per_s is None else f"{figures.tokens_per_s:.1f}"
            self.live_bubble.set_note(f"generating… {rate} tok/s")

    # ----- the engine ------------------------------------------------------------------

    def on_engine_died(self, event: EngineDied) -> None:
        """Stop asking a dead engine for figures; the event bubbles on to the app, which explains."""
        if event.engine is not self.engine:
            event.stop()  # from an engine already replaced: old news
            return
        self.engine_lost = True

    def use_engine(self, engine: EngineClient) -> None:
        """Carry on with a new engine: every open chat (and every chat opened later) uses it."""
        self.engine = engine
        for chat in self.chats.values():
            chat.session.engine = engine
        self.engine_lost = False
        self.refresh_figures()

    def new_session(self) -> Session:
        """A new stored session with the settings' system prompt, if they name one."""
        name = self.settings.prompt
        if name is None:
            return Session.new(self.engine, self.store)
        from localpaged.chat.prompts import get_prompt

        prompt = get_prompt(name)
        return Session.new(self.engine, self.store, system=prompt.text, prompt_name=prompt.name)

    # ----- events from widgets --------------------------------------------------------

    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        chat = self.current
        if chat is None:
            try:
                chat = self.adopt(self.new_session())
            except LocalpagedError as err:  # the settings' prompt file went missing or broke meanwhile
                self.notify(str(err), title="New chat", severity="error")
                self.query_one(ChatInput).text = event.text
                return
            await self.open(chat.session.id)
        if not await self.start_reply(chat, event.text):
            self.query_one(ChatInput).text = event.text  # keep what was typed for later

    async def on_option_list_option_selected(self, event: SessionList.OptionSelected) -> None:
        if event.option_list is self.sidebar and event.option.id and event.option.id != self.open_id:
            await self.open(event.option.id)

    # ----- actions (those with a dialog are in ChatActions) --------------------------

    async def action_stop(self) -> None:
        chat = self.current
        if chat is not None and chat.generating:
            await chat.stop()

    async def action_regenerate(self) -> None:
        chat = self.current
        if chat is None or not any(m.role == "user" for m in chat.visible_history()):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        if not chat.generating:
            for bubble in reversed(self.messages.bubbles):
                if bubble.role != "assistant":
                    break
                await bubble.remove()
        await self.start_reply(chat, None)

    async def action_continue(self) -> None:
        """Let the last reply, cut off by a token limit, go on in the same message."""
        chat = self.current
        reply = chat.session.continuable() if chat is not None and not chat.generating else None
        if chat is None or reply is None:
            capabilities = self.engine.info.capabilities
            if not capabilities.continue_reply:
                self.notify(
                    f"Continue is off on this engine: {capabilities.why_off('continue_reply')}.",
                    severity="warning",
                    timeout=8,
                )
            else:
                self.notify("Only a reply that stopped at a token limit can be continued.", severity="warning")
            return
        bubbles = self.messages.bubbles
        if bubbles and bubbles[-1].role == "assistant":
            await bubbles[-1].remove()
        await self.start_reply(chat, None, resume=reply.content)

    def action_chat_settings(self) -> None:
        """Edit the open chat's own settings; they apply from its next reply on. A new system prompt
        forks the chat (its replies were written under the old one), unless it has no messages yet."""
        chat = self.current
        if chat is None:
            self.notify("Open or start a chat first.", severity="warning")
            return
        defaults = self.settings.sampling
        shown = {name: getattr(defaults, name) for name in CHAT_SETTINGS}

        async def save(choice: ChatSettingsChoice | None) -> None:
            if choice is None:
                return
            try:
                chat.session.set_settings(choice.settings)
                target = chat.session
                if choice.system != chat.session.system:
                    target = chat.session.with_system(choice.system)
            except LocalpagedError as err:
                self.notify(str(err), title="Chat settings", severity="error")
                return
            if target is chat.session:
                self.show_title()
                self.refresh_bindings()
                return
            fork = self.adopt(target)
            self.refresh_sidebar()
            await self.open(fork.session.id)
            self.notify(
                f"A fork with the new system prompt; “{chat.session.title or 'Untitled'}” keeps the old one.",
                title="Chat settings",
            )

        dialog = ChatSettingsDialog(chat.session.settings, shown, chat.session.system, self.action_chat_tools)
        self.app.push_screen(dialog, save)

    def action_mcp_tools(self) -> None:
        """The configured MCP servers, their state, and each tool's description and schema."""
        self.app.push_screen(ToolsDialog(self.app.mcp))

    def action_chat_tools(self) -> None:
        """Pick the tools the open chat may use (stored with it, shown in its title line)."""
        chat = self.current
        if chat is None:
            self.notify("Open or start a chat first.", severity="warning")
            return

        def save(keys: list[str] | None) -> None:
            if keys is None:
                return
            chat.session.set_tools(keys)
            self.show_title()

        capabilities = self.engine.info.capabilities
        disabled = "" if capabilities.tools else f"Tools are off on this engine: {capabilities.why_off('tools')}."
        self.app.push_screen(ToolsDialog(self.app.mcp, chat.session.tools_chosen, disabled), save)

    def action_toggle_kv_map(self) -> None:
        panel = self.query_one(KVMapPanel)
        panel.display = not panel.display
        self.refresh_figures()

    async def action_next_chat(self, step: int) -> None:
        ids = [e.id for e in self.sidebar.entries]
        if ids:
            index = ids.index(self.open_id) + step if self.open_id in ids else 0
            await self.open(ids[index % len(ids)])

    async def action_open_nth(self, index: int) -> None:
        entries = self.sidebar.entries
        if index < len(entries):
            await self.open(entries[index].id)
