"""Shared fixtures: tiny random Llama/Qwen2 models on the real tokenizer, and the real default model.

The tiny models are written once per test session as ordinary Hugging Face folders (config.json,
safetensors, the default model's tokenizer files), so they go through the same loader as any user
model and Hugging Face transformers can load the very same folder as the oracle.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch


def _load_the_installed_kernels_package() -> None:
    """transformers imports the hub's ``kernels`` package where it is installed (a requirement of transformers 5.2x),
    and pytest puts the checkout first on sys.path, where our kernels/ folder (installed as localpaged.kernels) has
    that name: the oracle's import failed. The installed one is loaded once, from everywhere but the checkout."""
    checkout = Path(__file__).resolve().parent.parent
    kept = sys.path[:]
    sys.path[:] = [p for p in kept if Path(p or ".").resolve() != checkout]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # not installed: transformers does not look for it
    finally:
        sys.path[:] = kept


_load_the_installed_kernels_package()

if not torch.cuda.is_available():
    # Triton kernels run through the interpreter on the CPU; this must be set before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The engine's device in tests; gpu_check.sh sets cuda to run the parity tests there (HF stays on the CPU).
DEVICE = os.environ.get("LOCALPAGED_TEST_DEVICE", "cpu")
# The model the tests marked ``model`` run: None is the default model; gpu_check.sh names a stand-in.
DEFAULT_MODEL = os.environ.get("LOCALPAGED_TEST_MODEL_FOLDER") or None

TINY_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,  # peaked logits: greedy choices are rarely near-ties
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# The compiled kernels, converted GGUF metadata and weight digests of test runs: the checkout's own (build/ is
# ignored), never the user's cache, and kept between runs so that the suite builds the kernels once.
TEST_CACHE = Path(__file__).resolve().parent.parent / "build" / "test-cache"


@pytest.fixture(scope="session", autouse=True)
def session_folders(tmp_path_factory) -> Path:
    """A home, a cache and a disk KV tier of the test session's own, for the engines shared by many tests
    (``default_llm``): session fixtures are made before any test's, so the per-test folders below come too late
    for them. Nothing a test run does reaches the user's real home or cache."""
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    folders = {
        "LOCALPAGED_HOME": tmp_path_factory.mktemp("home-session"),
        "LOCALPAGED_CACHE": TEST_CACHE,
        "LOCALPAGED_KV_CACHE": tmp_path_factory.mktemp("kv-session"),
    }
    before = {var: os.environ.get(var) for var in folders}
    os.environ.update({var: str(folder) for var, folder in folders.items()})
    yield folders["LOCALPAGED_KV_CACHE"]
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture(autouse=True)
def kv_disk(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty home and disk KV tier for each test: runs never share state, and a prompt's first
    ``cached_tokens`` are 0 as they would be without the tier (the user's own are never touched)."""
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path_factory.mktemp("home")))
    folder = tmp_path_factory.mktemp("kv")
    monkeypatch.setenv("LOCALPAGED_KV_CACHE", str(folder))
    return folder


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The default model's config and tokenizer files (its GGUF metadata, written to the cache once).

    ``LOCALPAGED_TEST_MODEL_FOLDER`` stands in another folder: the GPU machine cannot receive the
    98 MB GGUF, so gpu_check.sh gives it a random-weight model of the same shape and tokenizer.
    """
    from localpaged.models.loader import resolve_model

    if DEFAULT_MODEL:
        return Path(DEFAULT_MODEL)
    return resolve_model(None).folder


@pytest.fixture(scope="session")
def default_model_source() -> Path:
    """Where the default model's weights are: its GGUF file, or the stand-in folder (see above)."""
    from localpaged.models.loader import default_model_path

    return Path(DEFAULT_MODEL) if DEFAULT_MODEL else default_model_path()


def _write_tiny(folder: Path, tokenizer_src: Path, arch: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    vocab = 49152
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, rope_theta=10000.0, **TINY_COMMON))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, rope_theta=1000000.0, **TINY_COMMON))
    return save_hf_folder(model, folder, tokenizer_src)


def save_hf_folder(model, folder: Path, tokenizer_src: Path) -> Path:
    """A transformers ``model`` as a Hugging Face folder (safetensors) with the tokenizer files of ``tokenizer_src``."""
    model.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer_src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, default_model_folder) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny-llama"), default_model_folder, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, default_model_folder) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny-qwen2"), default_model_folder, "qwen2")


@pytest.fixture(scope="session")
def gguf_tokenizer() -> list:
    """The default model's tokenizer metadata, for the tiny GGUF files tests write (tests/gguf_models.py)."""
    from localpaged.models.loader import default_model_path
    from tests.gguf_models import tokenizer_fields

    return tokenizer_fields(default_model_path())


@pytest.fixture
def tiny_llm(tiny_model_path):
    """Factory: ``tiny_llm(**engine_config) -> LLM`` on the tiny Llama, float32 on the CPU."""
    from localpaged import LLM

    def make(**config):
        config.setdefault("dtype", "float32")
        config.setdefault("device", DEVICE)
        config.setdefault("kv_cache_memory", "64MiB")
        config.setdefault("max_model_len", 1024)
        return LLM(str(tiny_model_path), **config)

    return make


@pytest.fixture(scope="session")
def default_hf(default_model_source: Path):
    """transformers' own model of the default model's file in float32: the oracle, loaded once (reading a GGUF
    through transformers takes it tens of seconds)."""
    from tests.oracle import load_hf

    return load_hf(default_model_source)


@pytest.fixture(scope="session")
def default_llm():
    """The real default model in float32 on the CPU with float32 KV (the exact path, which the parity
    tests compare with Hugging Face), shared by the tests marked ``model``."""
    from localpaged import LLM

    return LLM(
        DEFAULT_MODEL,
        dtype="float32",
        kv_cache_dtype="float32",
        activations="float32",
        device=DEVICE,
        kv_cache_memory="1GiB",
        max_model_len=2048,
    )


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user prompts folder in a throwaway LOCALPAGED_HOME."""
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    folder = tmp_path / "prompts"
    folder.mkdir()
    return folder


@pytest.fixture
def fake():
    """The scripted FakeLLM (tests/engine/fake_llm.py): replies that depend on the prompt, no model."""
    from tests.engine.fake_llm import FakeLLM

    return FakeLLM()


@pytest.fixture
def engine(fake):
    """An AsyncLLM over ``fake``, on a thread: the front end as the chat layer and the app use it."""
    from localpaged.engine.async_llm import AsyncLLM

    engine = AsyncLLM(llm=fake)
    yield engine
    engine.shutdown()
