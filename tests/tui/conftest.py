"""Fixtures for the TUI tests: a fake engine, a real in-memory ChatStore, and the app on both."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine
from pilot_helpers import NOW

from localpaged.chat.store import ChatStore
from localpaged.tui.app import LocalpagedApp


@pytest.fixture
def anyio_backend() -> str:
    """Pilot tests are async; anyio's pytest plugin runs them on asyncio (Textual's loop)."""
    return "asyncio"


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    """Keep the user's own prompt folder and database out of the tests."""
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path / "home"))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def store() -> ChatStore:
    store = ChatStore(":memory:")
    yield store
    store.close()


@pytest.fixture
def make_app(engine, store) -> Callable[..., LocalpagedApp]:
    def make(**kwargs) -> LocalpagedApp:
        return LocalpagedApp(engine_factory=lambda progress: engine, store=store, clock=lambda: NOW, **kwargs)

    return make
