"""What the user gave stays as given; what the engine settled on is a separate record, reported everywhere."""

from __future__ import annotations

import dataclasses

import pytest

from localpaged.config import FIELDS, EngineConfig, ResolvedConfig, check_field
from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.llm import LLM
from localpaged.errors import ConfigError


def test_the_engine_never_rewrites_the_users_config(tiny_model_path) -> None:
    given = {"model": str(tiny_model_path), "kv_cache_memory": "64MiB", "max_model_len": None, "kv_disk": False}
    llm = LLM(**given)
    assert llm.config == EngineConfig(**given)  # "auto" stays "auto", "64MiB" stays "64MiB", None stays None
    assert (llm.config.device, llm.config.dtype, llm.config.kv_cache_dtype) == ("auto", "auto", "auto")
    resolved = llm.resolved
    assert (resolved.device, resolved.dtype, resolved.attention) == ("cpu", "float32", "torch")
    assert resolved.max_model_len == 2048 and resolved.max_num_batched_tokens == 512  # the tiny model's context
    assert (
        resolved.num_blocks == llm.pool.num_blocks and resolved.kv_cache_bytes == resolved.num_blocks * llm.block_bytes
    )
    assert resolved.kv_cache_bytes <= 64 * 2**20 and not resolved.kv_disk
    assert llm.info.resolved is resolved and llm.info.max_model_len == resolved.max_model_len


def test_the_config_is_frozen() -> None:
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "cpu"  # type: ignore[misc]


def test_every_field_is_declared_once() -> None:
    """One table holds every field's type and range; EngineConfig checks each field through it."""
    assert list(FIELDS) == [f.name for f in dataclasses.fields(EngineConfig)]
    with pytest.raises(ConfigError, match="'colour' is not an engine setting"):
        check_field("colour", 1)


def test_the_environment_is_read_once_at_start(tiny_model_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCALPAGED_ATTENTION", "torch")
    llm = LLM(str(tiny_model_path), kv_cache_memory="64MiB", kv_disk=False)
    assert llm.config.attention is None and llm.resolved.attention == "torch"
    monkeypatch.setenv("LOCALPAGED_ATTENTION", "fast")
    with pytest.raises(ConfigError, match="^LOCALPAGED_ATTENTION: attention='fast': use 'triton', 'torch'"):
        LLM(str(tiny_model_path), kv_cache_memory="64MiB", kv_disk=False)


def test_the_core_process_reports_what_it_settled_on(tiny_model_path) -> None:
    with AsyncLLM(str(tiny_model_path), kv_cache_memory="64MiB", kv_disk=False) as engine:
        assert engine.config == EngineConfig(model=str(tiny_model_path), kv_cache_memory="64MiB", kv_disk=False)
        assert isinstance(engine.info.resolved, ResolvedConfig)
        assert engine.info.resolved.device == "cpu" and engine.info.max_model_len == 2048
        assert engine.stats().blocks_total == engine.info.resolved.num_blocks
