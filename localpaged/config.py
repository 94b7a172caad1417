"""EngineConfig: every knob of the engine as the user gave it; ResolvedConfig: what the engine settled on.

``EngineConfig`` is frozen and never rewritten: "auto" stays "auto" and "2GiB" stays "2GiB". Each
field's type and range is declared once, in ``FIELDS``, and ``check_field`` is the one check that
code, the settings file and the command line all go through. What "auto" and None became on this
machine (device, dtypes, context, token budget, kernel path) is a separate ``ResolvedConfig``, made by
``engine.setup`` and reported by ``LLM.resolved``, the engines' ``info`` and ``localpaged config show``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from localpaged.errors import ConfigError

BLOCK_SIZE = 16
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
FLOAT_TYPES = ("auto", "float32", "bfloat16", "float16")


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """``2147483648``, ``"2GiB"``, ``"512 MB"`` -> bytes; ``name`` is the setting, for the error."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name}={value!r} ({type(value).__name__}): write bytes (an int) or a size such as '2GiB'")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}={value!r} is not a size; write bytes or e.g. '2GiB', '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Field:
    """One setting's type and range: what ``check_field`` holds a value to."""

    types: tuple[type, ...]
    want: str  # the type in words, for the message
    optional: bool = False  # None is allowed
    choices: tuple[str, ...] = ()  # the allowed texts (besides a "cuda:N" device)
    minimum: int | None = None  # for whole numbers
    size: bool = False  # bytes or a size text such as "2GiB"
    hint: str = ""  # what the choices mean, added to a message about a bad choice


FIELDS: dict[str, Field] = {
    "model": Field((str, os.PathLike), "a path (str)", optional=True),
    "device": Field((str,), "text, e.g. 'cpu'", choices=("auto", "cpu", "cuda")),
    "dtype": Field((str,), "a type name such as 'float32'", choices=FLOAT_TYPES),
    "weights": Field(
        (str,), "text, 'auto' or 'float'", choices=("auto", "float"), hint="'auto' keeps a GGUF's own blocks"
    ),
    "kv_cache_memory": Field((int, str), "bytes or a size such as '2GiB'", optional=True, size=True),
    "kv_cache_dtype": Field(
        (str,),
        "a type name such as 'bfloat16'",
        choices=FLOAT_TYPES,
        hint="float32 is the exact path; 16 bits halve the KV cache's memory, attention still computes in float32",
    ),
    "activations": Field(
        (str,),
        "a type name: 'auto', 'float32', 'int16' or 'int8'",
        choices=("auto", "float32", "int16", "int8"),
        hint="float32 is the exact path; int16 and int8 round each input row, faster where the CPU has AVX-512 VNNI",
    ),
    "max_num_seqs": Field((int,), "a whole number", minimum=1),
    "max_num_batched_tokens": Field((int,), "a whole number", optional=True, minimum=1),
    "max_model_len": Field((int,), "a whole number", optional=True, minimum=2),
    "enable_prefix_caching": Field((bool,), "true or false"),
    "attention": Field((str,), "text, 'triton' or 'torch'", optional=True, choices=("triton", "torch")),
    "enforce_eager": Field((bool,), "true or false"),
    "num_threads": Field((int,), "a whole number", optional=True, minimum=1),
    "block_size": Field((int,), "a whole number"),
    "kv_disk": Field((bool,), "true or false"),
    "kv_disk_bytes": Field((int, str), "bytes or a size such as '2GiB'", size=True),
    "cascade_attention": Field((bool,), "true or false"),
    "speculative": Field(
        (str, Mapping),
        "text: 'auto', 'off', 'ngram' or 'suffix', or a draft model: {'draft': MODEL, 'k': N}",
        choices=("auto", "off", "ngram", "suffix"),
        hint="drafts from n-gram lookup in the request's own text ('ngram') and in earlier replies too ('suffix'); "
        "'auto' is 'suffix' while the batch is small; a draft model is {'draft': MODEL, 'k': N}",
    ),
}
DRAFT_KEYS = ("draft", "k")  # speculative = {"draft": MODEL, "k": N}: a draft model (engine.draft)
DRAFT_K = (1, 8)  # a draft model's k, the drafts a sequence proposes a step at most
DRAFT_K_DEFAULT = 3


def check_draft(value: Mapping) -> None:
    """ConfigError naming what to change, unless ``value`` is ``{"draft": MODEL, "k": N}`` (k optional).

    The draft's files and vocabulary are checked where the engine loads it (``engine.setup``)."""
    unknown = sorted(str(key) for key in value if key not in DRAFT_KEYS)
    if unknown:
        raise ConfigError(
            f"speculative={dict(value)!r}: unknown key(s) {', '.join(unknown)}; a draft model takes "
            "'draft' (a model path or name, as --model) and 'k' (drafts a step, 1 to 8)"
        )
    draft = value.get("draft")
    if not isinstance(draft, (str, os.PathLike)) or not str(draft).strip():
        raise ConfigError(
            f"speculative={dict(value)!r}: 'draft' must name the draft model (a .gguf file, a Hugging Face folder "
            "or a name `localpaged models` lists), e.g. {'draft': 'SmolLM2-135M.gguf', 'k': 3}"
        )
    k = value.get("k", DRAFT_K_DEFAULT)
    low, high = DRAFT_K
    if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= high:
        raise ConfigError(f"speculative={dict(value)!r}: 'k' must be a whole number from {low} to {high}")


def check_field(name: str, value: object) -> None:
    """ConfigError naming ``name``, ``value`` and what to write instead, unless ``value`` is one ``name`` takes.

    Types come first: settings come from TOML, flags and callers, and a '4' for 4 would otherwise
    fail later as a TypeError far from the mistake (or, for a bool, pass as 1).
    """
    spec = FIELDS.get(name)
    if spec is None:
        raise ConfigError(f"{name!r} is not an engine setting; the settings are: {', '.join(FIELDS)}")
    if value is None and spec.optional:
        return
    if (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types):
        raise ConfigError(f"{name}={value!r} ({type(value).__name__}) must be {spec.want}")
    if isinstance(value, Mapping):
        check_draft(value)
        return
    if spec.size and parse_bytes(value, name) <= 0:  # type: ignore[arg-type]
        raise ConfigError(f"{name}={value!r}: must be positive")
    if spec.choices and value not in spec.choices and not (name == "device" and str(value).startswith("cuda:")):
        allowed = ", ".join(repr(c) for c in spec.choices)
        raise ConfigError(f"{name}={value!r}: use {allowed}" + (f" ({spec.hint})" if spec.hint else ""))
    if spec.minimum is not None and isinstance(value, int) and value < spec.minimum:
        raise ConfigError(f"{name}={value}: must be at least {spec.minimum}")
    if name == "block_size" and value != BLOCK_SIZE:
        raise ConfigError(f"block_size is fixed at {BLOCK_SIZE}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings as given. None and "auto" leave a choice to the engine (``ResolvedConfig``)."""

    model: str | None = None  # None: the default model package; else a HF folder or a .gguf file
    device: str = "auto"  # "auto" (cuda if present), "cpu", "cuda"
    dtype: str = "auto"  # the model's compute type: "auto", "float32", "bfloat16", "float16"
    weights: str = "auto"  # a GGUF on the CPU in float32: "auto" keeps the file's blocks (native kernels); "float"
    kv_cache_memory: int | str | None = None  # bytes for the block pool; None sizes it from free memory
    kv_cache_dtype: str = "auto"  # the KV pool's values; float32 is the exact path (see setup.resolve_kv_dtype)
    activations: str = "auto"  # a GGUF's matmul inputs: "float32" (exact), "int16", "int8" (setup.resolve_activations)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # token budget per step; None picks one for the device
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    enable_prefix_caching: bool = True
    attention: str | None = None  # "triton" or "torch"; None: $LOCALPAGED_ATTENTION, else by device
    enforce_eager: bool = False  # CUDA only: skip CUDA-graph capture of decode steps
    num_threads: int | None = None  # CPU only: torch threads; None leaves torch's choice
    block_size: int = BLOCK_SIZE
    kv_disk: bool = True  # the disk tier below the block pool (see localpaged.engine.kv_disk)
    kv_disk_bytes: int | str = 2 * 2**30  # the disk tier's size limit; least recently used blocks go first
    cascade_attention: bool = True  # shared-prefix attention: a prefix common to the batch's sequences read once
    # speculative decoding's draft tokens (engine.speculative); greedy output is unchanged. A mapping
    # {"draft": MODEL, "k": N} drafts with a smaller model of the same vocabulary (engine.draft).
    speculative: str | Mapping = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class ResolvedConfig:
    """What the engine settled on for an ``EngineConfig`` on this machine: every "auto" and None decided."""

    device: str  # "cpu", "cuda:0"
    dtype: str  # the model's compute type
    kv_cache_dtype: str
    weights: str  # "auto" (a GGUF's own blocks on the native kernels) or "float"
    activations: str  # "float32", "int16" or "int8"
    attention: str  # the attention path: "torch" (native kernels where they build) or "triton"
    cpu_kernels: str | None  # the native kernels' instruction-set path, None where they do not run
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    kv_cache_bytes: int  # the pool's size
    num_blocks: int
    enable_prefix_caching: bool
    kv_disk: bool  # the disk tier is open
    cascade_attention: bool
    huge_pages: bool = False  # packed weights copied onto 2 MiB pages once the engine runs (models/huge_pages.py)
    speculative: str = "off"  # the draft proposer: "off", "ngram", "suffix" or "draft" (a draft model)
    speculative_max_rows: int | None = None  # a step's decode rows at most, drafts included; None: no limit
    speculative_draft: str | None = None  # the draft model's name, with "draft"
    speculative_k: int | None = None  # the most drafts a sequence proposes a step, with "draft"
