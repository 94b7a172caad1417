"""Snapshots of the main screen, the new-chat dialog, search and the KV map, on fixed data."""

from __future__ import annotations

from pathlib import Path

import pytest
from pilot_helpers import NOW, main_screen, wait_for

from localpaged.chat.prompts import Prompt
from localpaged.tui.screens.search import SearchDialog

SIZE = (120, 40)
REPLY = """Use a list comprehension:

```python
def squares(n: int) -> list[int]:
    return [i * i for i in range(n)]
```

It is **short** and fast."""
PROMPTS = [
    Prompt(
        "coding",
        "Coding assistant",
        "Careful, correct code with short explanations.",
        "You are a careful programmer.",
        Path("coding.md"),
        True,
    ),
    Prompt(
        "tutor",
        "Patient tutor",
        "Explains step by step and checks understanding.",
        "You are a patient tutor.",
        Path("tutor.md"),
        True,
    ),
]


@pytest.fixture
def chats(store):
    """Three chats with fixed times and metrics; the newest holds a reply with code."""
    for age, title, system, messages in [
        (3 * 86400, "Trip to Lisbon", None, [("user", "Three days in Lisbon?"), ("assistant", "Day one: Alfama.")]),
        (2 * 3600, "Pasta timing", None, [("user", "How long for spaghetti?"), ("assistant", "Until al dente.")]),
        (
            300,
            "Squares in Python",
            "You are a careful programmer.",
            [("user", "How do I list the first n squares?"), ("assistant", REPLY)],
        ),
    ]:
        session = store.create_session(title=title, system=system, prompt_name="coding" if system else None)
        for role, text in messages:
            metrics = {"tokens_per_s": 48.5, "ttft_s": 0.12} if role == "assistant" else {}
            store.add_message(session.id, role, text, **metrics)
        store.db.execute(
            "UPDATE sessions SET created = ?, updated = ? WHERE id = ?", [NOW - age, NOW - age, session.id]
        )
    return store


def settle(*keys: str):
    """run_before for snap_compare: wait for the chat screen and its figures, then press keys."""

    async def run_before(pilot) -> None:
        screen = await main_screen(pilot)
        await wait_for(pilot, lambda: "fake-135M" in str(screen.query_one("#status").content))
        await pilot.press(*keys)
        for box in [*screen.query("Input, TextArea"), *pilot.app.screen.query("Input, TextArea")]:
            box.cursor_blink = False  # a blinking cursor would make the snapshots flaky
        await pilot.pause(0.3)

    return run_before


def test_main_screen(snap_compare, make_app, chats):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=settle())


def test_new_chat_dialog(snap_compare, make_app, chats, monkeypatch):
    monkeypatch.setattr("localpaged.tui.actions.list_prompts", lambda problems=None: PROMPTS)
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=settle("ctrl+n", "down"))


def test_search(snap_compare, make_app, chats):
    async def run_before(pilot) -> None:
        await settle("ctrl+f", *"dente")(pilot)
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SearchDialog) and pilot.app.screen.hits)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


def test_kv_map(snap_compare, make_app, chats):
    async def run_before(pilot) -> None:
        await settle("ctrl+g")(pilot)
        await wait_for(pilot, lambda: "blocks" in str(pilot.app.screen.query_one("#kv-figures").content))

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)
