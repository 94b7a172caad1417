"""Fixtures shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf_models import NATIVE_TYPES, tiny_hf_model, write_gguf


@pytest.fixture(scope="session")
def native_llama(tmp_path_factory, gguf_tokenizer) -> Path:
    """A tiny random Llama GGUF with every native block type over two layers, every projection on the CPU kernels."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-native-llama.gguf"
    return write_gguf(path, tiny_hf_model("llama"), "llama", NATIVE_TYPES, gguf_tokenizer)
