"""`localpaged models` and model names: fake Ollama, LM Studio, llama.cpp and Hugging Face stores in a temp folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from localpaged import cli
from localpaged.errors import ModelNotFoundError
from localpaged.models.catalog import find_model, find_models
from localpaged.models.loader import resolve_model
from tests.gguf_models import tiny_hf_model, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf_tokenizer) -> Path:
    types = {"token_embd.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K"}
    return write_gguf(
        tmp_path_factory.mktemp("src") / "tiny.gguf", tiny_hf_model("qwen2"), "qwen2", types, gguf_tokenizer
    )


def _ollama_store(root: Path, gguf: Path, name: str, tag: str, namespace: str = "library") -> Path:
    """Ollama's layout: the GGUF as a blob named by its digest, a manifest naming it (and a template layer)."""
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{digest}"
    blob.write_bytes(data)
    (root / "blobs" / "sha256-template").write_text("{{ .Prompt }}")
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:template", "size": 13},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


@pytest.fixture
def stores(tmp_path, monkeypatch, tiny_gguf) -> dict[str, Path]:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for var in ("OLLAMA_MODELS", "LLAMA_CACHE", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    blob = _ollama_store(tmp_path / "ollama", tiny_gguf, "qwen2.5", "1.5b")
    _ollama_store(tmp_path / "ollama", tiny_gguf, "tiny", "latest", namespace="someone")
    lmstudio = home / ".lmstudio" / "models" / "publisher" / "repo" / "tiny-Q4_K_M.gguf"
    lmstudio.parent.mkdir(parents=True)
    lmstudio.write_bytes(tiny_gguf.read_bytes())
    (home / ".cache" / "llama.cpp").mkdir(parents=True)
    (home / ".cache" / "llama.cpp" / "broken.gguf").write_bytes(b"GGUF\x03\x00")  # cut short: listed, marked unreadable
    return {"blob": blob, "lmstudio": lmstudio}


def test_the_stores_are_listed_with_size_quantisation_and_architecture(stores):
    found = {m.name: m for m in find_models()}
    assert sorted(found) == ["broken.gguf", "publisher/repo/tiny-Q4_K_M.gguf", "qwen2.5:1.5b", "someone/tiny:latest"]
    ollama = found["qwen2.5:1.5b"]
    assert (ollama.source, ollama.path, ollama.architecture) == ("ollama", stores["blob"], "qwen2")
    assert ollama.size == stores["blob"].stat().st_size
    assert ollama.quantization == "Q8_0"  # the writer names no file type: the type most of the bytes are in
    assert (found["broken.gguf"].source, found["broken.gguf"].architecture) == ("llama.cpp", "?")


def test_an_ollama_name_resolves_through_its_manifest(stores):
    assert find_model("qwen2.5:1.5b") == ("qwen2.5:1.5b", stores["blob"])
    assert find_model("someone/tiny") == ("someone/tiny:latest", stores["blob"])  # the tag defaults to latest
    assert find_model("qwen2.5:7b") is None
    files = resolve_model("qwen2.5:1.5b")
    assert (files.name, files.gguf) == ("qwen2.5:1.5b", stores["blob"])
    assert resolve_model("publisher/repo/tiny-Q4_K_M.gguf").gguf == stores["lmstudio"]


def test_a_listed_name_runs(stores):
    from localpaged import LLM, SamplingParams

    llm = LLM(model="qwen2.5:1.5b", device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    assert llm.model_name == "qwen2.5:1.5b"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_an_unknown_name_says_where_it_looked(stores):
    with pytest.raises(ModelNotFoundError, match=r"no model named 'llama3.2:3b' in Ollama.*`localpaged models`"):
        resolve_model("llama3.2:3b")


def test_the_models_command_prints_a_table(stores, capsys):
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "QUANT", "ARCH", "SOURCE"]
    row = next(line for line in lines if line.startswith("qwen2.5:1.5b")).split()
    assert row[1:] == [f"{stores['blob'].stat().st_size / 2**30:.2f}", "GiB", "Q8_0", "qwen2", "ollama"]
    broken = next(line for line in lines if line.startswith("broken.gguf")).split()
    assert broken[1:] == ["0.00", "GiB", "?", "?", "llama.cpp"]
