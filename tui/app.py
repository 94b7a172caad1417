"""LocalpagedApp: start the engine behind a loading screen, then chat; `run_app` for the CLI."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from localpaged.tui.screens.error import ErrorScreen
from localpaged.tui.screens.loading import LoadingScreen
from localpaged.tui.screens.main import MainScreen
from textual import work
from textual.app import App, SystemCommand
from textual.screen import Screen

from localpaged.errors import LocalpagedError

Progress = Callable[[str, "float | None"], None]
EngineFactory = Callable[[Progress], Any]


def default_engine_factory(model: str | None) -> EngineFactory:
    """Build the real AsyncLLM (imported late: torch and the model load only in the worker)."""

    def make(progress: Progress) -> Any:
        from localpaged.engine.async_llm import AsyncLLM

        return AsyncLLM(model, progress=progress)

    return make


class LocalpagedApp(App[None]):
    """Many chats streaming at once against one engine.

    The engine is built in a thread worker so the loading screen stays live; `engine_factory`
    and `store` can be injected (tests pass a fake engine and an in-memory store).
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
    ) -> None:
        super().__init__()
        self.engine_factory = engine_factory or default_engine_factory(model)
        self.store = store
        self.prompt = prompt
        self.session_id = session_id
        self.db = db
        self.clock = clock
        self.engine: Any = None

    def on_mount(self) -> None:
        loading = LoadingScreen()
        self.push_screen(loading)
        self.start(loading)

    @work(thread=True, exclusive=True, group="startup")
    def start(self, loading: LoadingScreen) -> None:
        """Load the model, open the store, and resolve --prompt / --session, or explain why not."""
        try:
            self.engine = self.engine_factory(lambda msg, frac: self.call_from_thread(loading.progress, msg, frac))
            if self.store is None:
                from localpaged.chat.store import ChatStore

                self.store = ChatStore(self.db)
            open_id = self._first_session()
        except LocalpagedError as err:
            self.call_from_thread(self.switch_screen, ErrorScreen(str(err)))
            return
        self.call_from_thread(self.switch_screen, MainScreen(self.engine, self.store, self.clock, open_id))

    def _first_session(self) -> str | None:
        """The session to open first: the one asked for, or a new one with the asked-for prompt."""
        from localpaged.chat.prompts import get_prompt
        from localpaged.chat.session import Session

        if self.session_id is not None:
            return Session.load(self.engine, self.store, self.session_id).id
        if self.prompt is not None:
            prompt = get_prompt(self.prompt)
            return Session.new(self.engine, self.store, system=prompt.text, prompt_name=prompt.name).id
        return None

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Every chat action is in the command palette too, titled like its footer entry."""
        yield from super().get_system_commands(screen)
        main = next((s for s in self.screen_stack if isinstance(s, MainScreen)), None)
        if main is None:
            return
        for binding in main.BINDINGS:
            yield SystemCommand(
                binding.description,
                f"{binding.description} ({binding.key})",
                lambda action=binding.action: main.run_action(action),
            )

    async def action_quit(self) -> None:
        """Stop every reply (their partial text is kept), shut the engine down, then exit."""
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen):
                await asyncio.gather(*(chat.stop() for chat in screen.chats.values()))
        await self.workers.wait_for_complete([w for w in self.workers if w.group == "replies"])
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        self.exit()


def run_app(
    model: str | None = None, prompt: str | None = None, session_id: str | None = None, db: str | None = None
) -> None:
    """Entry point of `localpaged chat`."""
    LocalpagedApp(model=model, prompt=prompt, session_id=session_id, db=db).run()
