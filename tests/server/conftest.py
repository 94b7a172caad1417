"""The server tests' engines: the tiny model, one AsyncLLM a module, and the synchronous LLM its replies must equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from localpaged.engine.async_llm import AsyncLLM
from tests.server.running import TINY


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    engine = AsyncLLM(str(tiny_model_path), **TINY)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path):
    """The synchronous engine on the same model: what the server's greedy replies must equal."""
    from localpaged import LLM

    return LLM(str(tiny_model_path), **TINY)
