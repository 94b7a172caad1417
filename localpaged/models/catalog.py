"""The model files a user already has, found where other tools keep them (``locations.model_store_dirs()``).

Nothing is downloaded or written: listing walks those folders and reads each GGUF's header (a
short read a file) for its architecture and quantisation. An Ollama model is a manifest
(``manifests/<registry>/<namespace>/<model>/<tag>``, JSON) naming its layers by digest; the layer of
media type ``application/vnd.ollama.image.model`` is the GGUF itself, ``blobs/sha256-<hex>``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from localpaged.locations import model_store_dirs

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
MANIFEST_LIMIT = 1 << 20  # a manifest is a few hundred bytes; anything this big is not one


@dataclass(frozen=True)
class LocalModel:
    name: str  # what --model takes: "qwen2.5:1.5b" (Ollama), "publisher/repo/file.gguf", "org/repo" ...
    path: Path  # the GGUF file, or a Hugging Face snapshot folder
    source: str  # "ollama", "lmstudio", "llama.cpp" or "huggingface"
    size: int  # bytes
    architecture: str  # from the GGUF header or config.json; "?" where the file cannot be read
    quantization: str  # "Q4_K_M", "F16" ...; "safetensors" for a Hugging Face folder


def find_models() -> list[LocalModel]:
    """Every model file in the usual places, with its size, quantisation and architecture.

    One file another tool left broken never hides the rest: it is listed with "?" for what could not be read.
    """
    return [_describe_or_unknown(source, name, path) for source, name, path in _candidates()]


def _describe_or_unknown(source: str, name: str, path: Path) -> LocalModel:
    try:
        return _describe(source, name, path)
    except Exception:  # noqa: BLE001 -- any way a foreign file is broken; the listing goes on
        try:
            size = path.stat().st_size if path.is_file() else 0
        except OSError:
            size = 0
        return LocalModel(name, path, source, size, "?", "?")


def find_model(name: str) -> tuple[str, Path] | None:
    """``(listed name, path)`` of the model ``name`` names: an Ollama ``model[:tag]`` (tag "latest" when left
    out) or any other name ``localpaged models`` lists; None where nothing matches."""
    wanted = {name, f"{name}:latest"} if ":" not in name else {name}
    for _source, listed, path in _candidates():
        if listed in wanted:
            return listed, path
    return None


def _candidates() -> Iterator[tuple[str, str, Path]]:
    """``(source, name, path)`` of each model in each store folder that exists, in a stable order."""
    finders = {"ollama": _ollama, "lmstudio": _gguf_files, "llama.cpp": _gguf_files, "huggingface": _hf_hub}
    for source, folders in model_store_dirs().items():
        for folder in folders:
            if folder.is_dir():
                yield from ((source, name, path) for name, path in finders[source](folder))


def _ollama(root: Path) -> Iterator[tuple[str, Path]]:
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        try:
            if not manifest.is_file() or manifest.stat().st_size > MANIFEST_LIMIT:
                continue
            layers = json.loads(manifest.read_text()).get("layers", [])
            digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
            continue  # not a model's manifest (or not readable): nothing to list
        blob = root / "blobs" / digest.replace(":", "-")
        if not blob.is_file():
            continue
        registry, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        if registry == OLLAMA_REGISTRY:
            prefix = "" if namespace == "library" else f"{namespace}/"
        else:
            prefix = f"{registry}/{namespace}/"
        yield f"{prefix}{model}:{tag}", blob


def _gguf_files(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*.gguf")):
        if path.is_file():
            yield path.relative_to(root).as_posix(), path


def _hf_hub(root: Path) -> Iterator[tuple[str, Path]]:
    """GGUF files (``org/repo/file.gguf``) and safetensors folders (``org/repo``) of each repo's newest snapshot."""
    for repo in sorted(root.glob("models--*")):
        snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
        if not snapshots:
            continue
        snapshot = max(snapshots, key=lambda s: s.stat().st_mtime)
        name = repo.name.removeprefix("models--").replace("--", "/")
        if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
            yield name, snapshot
        for path in sorted(snapshot.rglob("*.gguf")):
            if path.is_file():
                yield f"{name}/{path.relative_to(snapshot).as_posix()}", path


def _describe(source: str, name: str, path: Path) -> LocalModel:
    if path.is_dir():
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        try:
            architecture = json.loads((path / "config.json").read_text()).get("model_type", "?")
        except (OSError, ValueError, AttributeError):
            architecture = "?"
        return LocalModel(name, path, source, size, architecture, "safetensors")
    from gguf import LlamaFileType

    from localpaged.models.gguf_file import GGUFFile

    file = GGUFFile(path)  # a broken file is listed with "?" by _describe_or_unknown
    file_type = file.metadata.get("general.file_type")
    try:
        quantization = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:  # no file type (or a newer one): the type most of the bytes are in
        by_bytes = Counter()
        for info in file.tensors.values():
            by_bytes[info.kind] += info.nbytes
        quantization = by_bytes.most_common(1)[0][0] if by_bytes else "?"
    return LocalModel(name, path, source, path.stat().st_size, file.architecture, quantization)
