"""Every engine implementation has every member its interface declares, with the same signature.

No type checker runs here, so this is what keeps the fakes the tests run on from drifting from the
real engines: a parameter added to AsyncLLM.stream and not to FakeEngine.stream fails here, not in
some later test that happens to pass the new argument.

- EngineClient (localpaged/engine/protocol.py): AsyncLLM, RemoteEngine, and the TUI tests' FakeEngine.
- The synchronous LLM's members that the engine core calls: the chat tests' FakeLLM, which AsyncLLM
  wraps in their place.

RemoteEngine's instance attribute (info) needs a server; tests/engine/test_remote.py
checks ``isinstance(engine, EngineClient)`` on a connected one.
"""

from __future__ import annotations

import inspect

import pytest

from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.llm import LLM
from localpaged.engine.protocol import EngineCapabilities, EngineClient, EngineInfo, EngineStats
from localpaged.engine.remote import RemoteEngine
from tests.engine.fake_llm import FakeLLM
from tests.tui.fake_engine import FakeEngine

# What the engine core (localpaged/engine/core.py) and AsyncLLM call on the LLM they drive.
CORE_CALLS = ("add_request", "step", "abort", "has_unfinished_requests", "encode_chat", "stats", "kv_map")
# What AsyncLLM reads of the LLM it wraps on a thread.
LLM_ATTRIBUTES = ("config", "info", "tokenizer")


def methods(interface: type) -> dict[str, object]:
    """The methods an interface declares (its own, not object's or Protocol's)."""
    return {
        name: member
        for name, member in vars(interface).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def test_the_protocol_declares_what_front_ends_use() -> None:
    """The list this test checks against is not empty by accident."""
    assert set(methods(EngineClient)) == {
        "encode_chat",
        "vocabulary",
        "stream",
        "iter_stream",
        "abort",
        "stats",
        "kv_map",
        "prefetch",
        "shutdown",
    }
    assert set(EngineClient.__annotations__) == {"info"}


@pytest.mark.parametrize("engine", [AsyncLLM, RemoteEngine, FakeEngine], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(methods(EngineClient)))
def test_engine_client_member_has_the_protocols_signature(engine: type, name: str) -> None:
    declared = methods(EngineClient)[name]
    implemented = getattr(engine, name, None)
    assert implemented is not None, f"{engine.__name__} has no {name}"
    assert inspect.signature(implemented) == inspect.signature(declared), f"{engine.__name__}.{name}"
    # abort is awaited; stream is iterated with ``async for``, iter_stream with ``for``.
    assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared)
    if name == "stream":
        assert inspect.isasyncgenfunction(implemented)
    if name == "iter_stream":
        assert inspect.isgeneratorfunction(implemented)


@pytest.mark.parametrize("name", CORE_CALLS)
def test_fake_llm_has_the_llms_signature(name: str) -> None:
    assert inspect.signature(getattr(FakeLLM, name)) == inspect.signature(getattr(LLM, name)), name


def test_instances_have_the_protocols_attributes() -> None:
    engine = AsyncLLM(llm=FakeLLM())
    try:
        for instance in (engine, FakeEngine()):
            assert isinstance(instance, EngineClient)
            assert isinstance(instance.info, EngineInfo) and isinstance(instance.info.capabilities, EngineCapabilities)
            assert isinstance(instance.info.model_name, str) and instance.info.max_model_len > 0
            assert isinstance(instance.stats(), EngineStats)
    finally:
        engine.shutdown()
