"""Draw docs/tui.svg, the README's picture of the terminal app (``make screenshot``).

Runs the real app (LocalpagedApp, as ``localpaged chat`` builds it) headless at 120x36 on the
default model. LOCALPAGED_HOME points at a temporary folder, so the user's chats and prompts are
never read or written (converted models still come from the usual cache). The script opens three
chats through the new-chat dialog (two with a shipped system prompt, one without), sends a
question in each one right after the other so that the three replies stream at once, waits until
all of them have finished, and saves the screen.

One change from ``localpaged chat``: every reply is sampled with the same seeded SamplingParams,
at most MAX_TOKENS tokens, so the replies are the same from run to run and the run takes a minute
or two on a CPU. The figures in the picture (tok/s, time to first token) are whatever this machine
measured during the run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

SIZE = (120, 36)
OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "tui.svg"
CHATS = [  # (shipped prompt, or "" for none; question), in the order they are opened
    ("concise", "Why is the sky blue?"),
    ("tutor", "What is a prime number?"),
    ("", "How do I reverse a list in Python?"),
]
SHOWN = 2  # the chat on screen in the picture: an index into CHATS
MAX_TOKENS = 160
LOAD_TIMEOUT_S = 600.0  # the first start converts the default model's GGUF file (about 20 s)
REPLY_TIMEOUT_S = 300.0


class FixedParams:
    """The real engine (an EngineClient), with every request sampled with the same ``params``."""

    def __init__(self, engine: Any, params: Any) -> None:
        self._engine = engine
        self._params = params

    def __getattr__(self, name: str) -> Any:  # model_name, config, encode_chat, abort, stats, ...
        return getattr(self._engine, name)

    def stream(self, prompt: Any, params: Any = None, request_id: str | None = None) -> AsyncIterator[Any]:
        return self._engine.stream(prompt, self._params, request_id)

    def iter_stream(self, prompt: Any, params: Any = None, request_id: str | None = None) -> Iterator[Any]:
        return self._engine.iter_stream(prompt, self._params, request_id)


async def wait_for(pilot: Any, condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.05)


async def draw(output: Path) -> None:
    from textual.widgets import OptionList

    from localpaged.engine.factory import make_engine
    from localpaged.sampling import SamplingParams
    from localpaged.tui.app import LocalpagedApp
    from localpaged.tui.screens.error import ErrorScreen
    from localpaged.tui.screens.main import MainScreen
    from localpaged.tui.screens.new_chat import NewChatDialog

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=7)
    app = LocalpagedApp(engine_factory=lambda progress: FixedParams(make_engine(progress=progress), params))
    try:
        async with app.run_test(size=SIZE) as pilot:
            print("loading the default model ...", file=sys.stderr)
            await wait_for(
                pilot,
                lambda: isinstance(app.screen, (MainScreen, ErrorScreen)),
                LOAD_TIMEOUT_S,
                "the chat screen",
            )
            if isinstance(app.screen, ErrorScreen):
                raise SystemExit(f"the app could not start: {app.screen.query_one('#error-message').content}")
            screen: MainScreen = app.screen
            chats = []
            for prompt, question in CHATS:
                before = screen.current
                await pilot.press("ctrl+n")
                await wait_for(pilot, lambda: isinstance(app.screen, NewChatDialog), 10, "the new-chat dialog")
                options = app.screen.query_one("#prompt-list", OptionList)
                options.highlighted = options.get_option_index(prompt) if prompt else 0  # 0: no system prompt
                await pilot.press("enter")
                await wait_for(pilot, lambda before=before: screen.current not in (None, before), 10, "the new chat")
                box = screen.query_one("#input")
                box.text = question
                await pilot.press("enter")
                chats.append(screen.current)
                print(f"asked {question!r} ({prompt or 'no system prompt'})", file=sys.stderr)
            await wait_for(pilot, lambda: not any(c.generating for c in chats), REPLY_TIMEOUT_S, "the replies")
            for chat in chats:
                reply = chat.session.last_reply
                print(f"{chat.session.title!r}: {reply.completion_tokens} tokens, {reply.status}", file=sys.stderr)
            await screen.open(chats[SHOWN].session.id)
            await wait_for(pilot, lambda: "tok/s" in str(screen.query_one("#status").content), 30, "the figures")
            for box in screen.query("Input, TextArea"):
                box.cursor_blink = False
            await pilot.pause(0.5)
            output.parent.mkdir(parents=True, exist_ok=True)
            app.save_screenshot(filename=output.name, path=str(output.parent))
            await pilot.press("ctrl+q")  # stops the engine core as quitting the app does
    finally:
        if app.store is not None:
            app.store.close()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="localpaged-screenshot-") as home:
        os.environ["LOCALPAGED_HOME"] = home  # set before anything looks up the chat database or prompts
        asyncio.run(draw(OUTPUT))
    print(f"wrote {OUTPUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
