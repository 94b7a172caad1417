"""LocalpagedApp: start the engine behind a loading screen, then chat; `run_app` for the CLI."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import termios
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from functools import partial
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from localpaged.chat.tools import McpServers
from localpaged.config_file import Settings, save_theme
from localpaged.engine.factory import make_engine
from localpaged.engine.protocol import EngineClient
from localpaged.errors import ConfigError, LocalpagedError
from localpaged.tui.live import EngineDied
from localpaged.tui.screens.engine_dead import EngineDeadScreen
from localpaged.tui.screens.error import ErrorScreen
from localpaged.tui.screens.loading import LoadingScreen
from localpaged.tui.screens.main import MainScreen

log = logging.getLogger(__name__)

TERMINAL_CHECK_S = 1.0  # how often the app makes sure it still has a terminal: one system call

EngineFactory = Callable[..., EngineClient]  # called with progress=Progress


class LocalpagedApp(App[None]):
    """Many chats streaming at once against one engine.

    The engine is built in a thread worker so the loading screen stays live; `engine_factory`
    and `store` can be injected (tests pass a fake engine and an in-memory store). If the engine
    dies, `engine_factory` builds its successor the same way, and the open chats carry on with it.
    `settings` (from the settings file, flags on top) give the replies' sampling and limit, the
    prompt of new chats, the theme and the keymap; a theme picked in the app is saved to the
    settings file (only when the settings came from one: tests and scripts leave files alone).
    """

    CSS_PATH = "app.tcss"
    TITLE = "localpaged"

    def __init__(
        self,
        engine_factory: EngineFactory | None = None,
        store: Any = None,
        *,
        model: str | None = None,
        prompt: str | None = None,
        session_id: str | None = None,
        db: str | None = None,
        clock: Callable[[], float] = time.time,
        settings: Settings | None = None,
        backend: str | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings if settings is not None else Settings()
        if engine_factory is None:  # the one choice of engine (engine.factory); a remote one reconnects the same way
            local = self.settings.engine.as_kwargs() if backend is None else {}
            engine_model = model if backend is not None else model or self.settings.model
            engine_factory = partial(make_engine, backend, model=engine_model, api_key=api_key, **local)
        self.engine_factory = engine_factory
        self.store = store
        self.prompt = prompt
        self.session_id = session_id
        self.db = db
        self.clock = clock
        self.engine: EngineClient | None = None
        self.engine_lost = False  # the engine died and no new one has taken over yet
        self.engine_remote = False  # the engine that died was a remote one
        # The settings' MCP servers, started in a thread of their own once the first screen is up: it never
        # waits for one, and each server's failure is one notice naming it.
        self.mcp = McpServers(self.settings.mcp_servers, on_change=self._mcp_changed)
        self._mcp_told: set[str] = set()

    def on_mount(self) -> None:
        loading = LoadingScreen()
        self.push_screen(loading)
        try:
            self.apply_settings()
        except ConfigError as err:
            self.switch_screen(ErrorScreen(str(err)))
            return
        self.start(loading)
        if not self.is_headless and sys.__stdin__ is not None and sys.__stdin__.isatty():
            self.set_interval(TERMINAL_CHECK_S, self._quit_if_terminal_gone)
        if not self.is_headless:  # `kill PID` quits as the quit key does: partial replies are kept
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: self.call_later(self.action_quit))

    def _mcp_changed(self) -> None:
        """From the servers' thread: a server became ready or failed."""
        with suppress(RuntimeError):  # the app is closing: nobody left to tell
            self.call_from_thread(self._tell_mcp_errors)

    def _tell_mcp_errors(self) -> None:
        for error in self.mcp.errors():
            if error not in self._mcp_told:
                self._mcp_told.add(error)
                self.notify(error, title="MCP server", severity="error", timeout=10, markup=False)

    def on_unmount(self) -> None:
        self.mcp.close()

    def apply_settings(self) -> None:
        """The settings' theme and keymap; from then on, a theme the user picks is remembered.

        A keymap naming a binding id the app does not have is a ConfigError (Textual would ignore it
        without a word, and the user would wonder why the key does nothing).
        """
        settings = self.settings
        if settings.keys:
            unknown = sorted(set(settings.keys) - binding_ids())
            if unknown:
                where = settings.path or "the settings"
                raise ConfigError(
                    f"{where}: [keys] names no binding {', '.join(unknown)}; "
                    f"the binding ids are: {', '.join(sorted(binding_ids()))}"
                )
            self.set_keymap(dict(settings.keys))
        if settings.theme:
            self.theme = settings.theme
        self._saved_theme = self.theme
        self.watch(self, "theme", self._remember_theme, init=False)

    def _remember_theme(self, theme: str) -> None:
        """Write a newly picked theme into the settings file, so the next start uses it."""
        if self.settings.path is None or theme == self._saved_theme:
            return
        try:
            save_theme(theme, self.settings.path)
        except ConfigError as err:
            self.notify(str(err), title="Theme not saved", severity="warning", timeout=8)
            return
        self._saved_theme = theme

    async def _quit_if_terminal_gone(self) -> None:
        """Quit (keeping every partial reply) once the terminal is gone.

        When the terminal closes under ``make chat`` (tmux killed, an SSH session dropped), no hang-up
        signal reaches the app, and Textual's input thread spins on the dead terminal: the app and its
        engine went on at a full core each, with nobody to see them, until killed by hand.
        """
        if terminal_gone(sys.__stdin__.fileno()):
            await self.action_quit()

    @work(thread=True, exclusive=True, group="startup")
    def start(self, loading: LoadingScreen) -> None:
        """Load the model, open the store, and resolve --prompt / --session, or explain why not."""
        try:
            self.engine = self.engine_factory(
                progress=lambda msg, frac: self.call_from_thread(loading.progress, msg, frac)
            )
            if self.store is None:
                from localpaged.chat.store import ChatStore

                self.store = ChatStore(self.db)
            open_id = self._first_session()
        except LocalpagedError as err:
            self.call_from_thread(self.switch_screen, ErrorScreen(str(err)))
            return
        main = MainScreen(self.engine, self.store, self.clock, open_id, settings=self.settings)
        self.call_from_thread(self.switch_screen, main)
        # Only now: on a machine of few cores their start would compete with loading the model.
        self.mcp.start()

    # ----- engine death and restart ----------------------------------------------------

    def on_engine_died(self, event: EngineDied) -> None:
        """Say once what happened, however many chats and refreshes report it, and offer a restart."""
        if event.engine is not self.engine or self.engine_lost:
            return  # old news: an engine already replaced, or already explained
        self.engine_lost = True
        self.engine_remote = event.remote  # what a failed restart's screen offers: restart, or connect again
        self._show_engine_dead(event.error)

    def _show_engine_dead(self, error: LocalpagedError) -> None:
        """Say why the engine is gone, and offer to start (or connect) again."""
        self.push_screen(EngineDeadScreen(str(error), remote=self.engine_remote), self._restart_chosen)

    def _restart_chosen(self, restart: bool | None) -> None:
        if restart:
            dead, self.engine = self.engine, None
            loading = LoadingScreen("Restarting the engine…")
            self.push_screen(loading)
            self.restart(loading, dead)

    @work(thread=True, exclusive=True, group="startup")
    def restart(self, loading: LoadingScreen, dead: EngineClient) -> None:
        """Shut the dead engine down, build a new one as at startup, or explain why not."""
        if dead is not None:
            try:
                dead.shutdown()
            except Exception:  # it is dead already: a new engine is what matters
                log.warning("shutting down the dead engine failed", exc_info=True)
        try:
            engine = self.engine_factory(progress=lambda msg, frac: self.call_from_thread(loading.progress, msg, frac))
        except LocalpagedError as err:
            self.call_from_thread(self._restart_failed, err, loading)
            return
        self.call_from_thread(self._restarted, engine, loading)

    def _restart_failed(self, error: LocalpagedError, loading: LoadingScreen) -> None:
        """Say why the new engine could not start, and offer to try again: a server still down is a dead end
        only until it is back."""
        if self.screen is loading:
            self.pop_screen()
        self._show_engine_dead(error)

    def _restarted(self, engine: EngineClient, loading: LoadingScreen) -> None:
        """Hand the new engine to the chat screen (and through it to every open chat), then show it."""
        self.engine, self.engine_lost = engine, False
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen):
                screen.use_engine(engine)
        if self.screen is loading:
            self.pop_screen()
        self.notify("The engine was restarted; your chats carry on.", title="Engine")

    def _first_session(self) -> str | None:
        """The session to open first: the one asked for, or a new one with the asked-for prompt."""
        from localpaged.chat.prompts import get_prompt
        from localpaged.chat.session import Session

        if self.session_id is not None:
            return Session.load(self.engine, self.store, self.session_id).id
        if self.prompt is not None:  # --prompt: a new chat with it (the settings' prompt is for new chats only)
            prompt = get_prompt(self.prompt)
            return Session.new(self.engine, self.store, system=prompt.text, prompt_name=prompt.name).id
        return None

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Every chat action the footer offers now is in the command palette too, titled like its footer entry."""
        yield from super().get_system_commands(screen)
        main = next((s for s in self.screen_stack if isinstance(s, MainScreen)), None)
        if main is None or isinstance(screen, (EngineDeadScreen, LoadingScreen, ErrorScreen)):
            return  # no chat actions while there is no engine to run them
        for binding in main.BINDINGS:
            if main.check_action(binding.action, ()) is False:
                continue  # hidden from the footer now (continue with nothing cut off): not offered here either
            yield SystemCommand(
                binding.description,
                f"{binding.description} ({binding.key})",
                lambda action=binding.action: main.run_action(action),
            )

    async def action_quit(self) -> None:
        """Stop every reply (their partial text is kept), shut the engine down, then exit."""
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen):
                screen.stop_refreshing()
                await asyncio.gather(*(chat.stop() for chat in screen.chats.values()))
        replies = [w for w in self.workers if w.group == "replies"]
        if replies:  # given none, Textual waits for every worker, and one it cancelled raises WorkerCancelled
            await self.workers.wait_for_complete(replies)
        await asyncio.to_thread(self.mcp.close)
        if self.engine is not None:
            with suppress(LocalpagedError):  # a dead engine has nothing left to shut down
                await asyncio.to_thread(self.engine.shutdown)
        self.exit()


def run_app(
    model: str | None = None,
    prompt: str | None = None,
    session_id: str | None = None,
    db: str | None = None,
    settings: Settings | None = None,
    backend: str | None = None,
    api_key: str | None = None,
) -> None:
    """Entry point of `localpaged chat`; ``settings`` default to the settings file's.

    With ``backend`` (an OpenAI-compatible server's URL) the chats run on that server's model, which
    ``model`` then names (None: the first it lists).
    """
    if settings is None:
        from localpaged.config_file import load_settings

        settings = load_settings()
    app = LocalpagedApp(
        model=model, prompt=prompt, session_id=session_id, db=db, settings=settings, backend=backend, api_key=api_key
    )
    try:
        app.run()
    finally:
        if app.store is not None:  # closing checkpoints the WAL: no chats.db-wal stays behind
            app.store.close()


def binding_ids() -> set[str]:
    """Every binding id a [keys] table may name: the chat screen's, the messages', the dialogs'."""
    from localpaged.tui.screens.chat_settings import ChatSettingsDialog
    from localpaged.tui.screens.confirm import ConfirmDialog
    from localpaged.tui.screens.edit import EditDialog
    from localpaged.tui.screens.new_chat import NewChatDialog
    from localpaged.tui.screens.search import SearchDialog
    from localpaged.tui.screens.text_dialog import TextDialog
    from localpaged.tui.widgets.bubble import MessageBubble
    from localpaged.tui.widgets.chat_input import ChatInput

    owners = [MainScreen, MessageBubble, ChatInput, NewChatDialog, SearchDialog, EditDialog, TextDialog]
    owners += [ConfirmDialog, ChatSettingsDialog, EngineDeadScreen, ErrorScreen]
    return {b.id for owner in owners for b in owner.BINDINGS if isinstance(b, Binding) and b.id}


def terminal_gone(fd: int) -> bool:
    """True once the terminal on ``fd`` has hung up (its other end closed): its settings cannot be read."""
    try:
        termios.tcgetattr(fd)
    except (termios.error, OSError):
        return True
    return False
