"""Fixtures of the chat-layer tests: an AsyncLLM over the scripted FakeLLM."""

from __future__ import annotations

import pytest

from localpaged.engine.async_llm import AsyncLLM
from tests.chat.fake_llm import FakeLLM


@pytest.fixture
def fake() -> FakeLLM:
    return FakeLLM()


@pytest.fixture
def engine(fake: FakeLLM):
    engine = AsyncLLM(llm=fake)
    yield engine
    engine.shutdown()
