"""The benchmarks import each other by file name, as they do when run; a tiny GGUF for them to run on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.gguf_models import MIXED_TYPES, tiny_hf_model, write_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, gguf_tokenizer) -> Path:
    """A tiny random Llama GGUF (2,048-token context) with plain, gguf-py-quantisable and K-format blocks."""
    path = tmp_path_factory.mktemp("bench-gguf") / "tiny-llama.gguf"
    return write_gguf(path, tiny_hf_model("llama"), "llama", MIXED_TYPES, gguf_tokenizer)
