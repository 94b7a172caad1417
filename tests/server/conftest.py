"""The server tests' engines: the tiny model, one AsyncLLM a module, and the synchronous LLM its replies must equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from localpaged.engine.async_llm import AsyncLLM
from tests.server.running import TINY, running_server

# The fuzz tests' engine: small enough that generated requests run to their end quickly, without a disk tier.
FUZZ = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "8MiB", "max_model_len": 128, "kv_disk": False}


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


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path: Path):
    """(url, engine) of a server over the core on a thread, for the HTTP fuzz tests."""
    engine = AsyncLLM(str(tiny_model_path), engine_process=False, **FUZZ)
    with running_server(engine) as url:
        yield url, engine
    engine.shutdown()
