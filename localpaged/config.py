"""EngineConfig: every knob of the engine in one dataclass, checked when it is made."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from localpaged.errors import ConfigError

BLOCK_SIZE = 16
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


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


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model package; else a HF folder or a .gguf file
    device: str = "auto"  # "auto" (cuda if present), "cpu", "cuda"
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    weights: str = (
        "auto"  # GGUF on the CPU in float32: "auto" keeps the file's blocks (native kernels); "float" dequantises
    )
    kv_cache_memory: int | str | None = None  # bytes for the block pool; None sizes it from free memory
    kv_cache_dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16": the KV pool's values (auto: float16
    # where the native CPU kernels run a float32 model, else the model's dtype; float32 is the exact path)
    activations: str = "auto"  # GGUF blocks on the CPU kernels: each matmul's input rows as "float32" (the exact
    # path), rounded to "int16" per run of 32 (faster on AVX-512 VNNI; greedy output as the exact path's, see the
    # README) or to "int8" as llama.cpp does (faster still; parts from the exact path early); with either, the
    # chunked prefill's attention rounds too (int16 q, K; bfloat16 weights, V). auto: int16 where the CPU has
    # AVX-512 VNNI, else float32
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # token budget per step; None picks one for the device
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    enable_prefix_caching: bool = True
    cascade_attention: bool = True  # sequences whose block tables begin with the same blocks (a shared system
    # prompt, forks, n samples) read those blocks once a step for all of them (shared-prefix attention), merged
    # with each one's own keys by log-sum-exp: the same tokens, float rounding apart; False: each reads its own
    attention: str | None = None  # "triton" or "torch"; None: $LOCALPAGED_ATTENTION, else by device
    enforce_eager: bool = False  # CUDA only: skip CUDA-graph capture of decode steps
    num_threads: int | None = None  # CPU only: torch threads; None leaves torch's choice
    block_size: int = BLOCK_SIZE
    kv_disk: bool = True  # the disk tier below the block pool (see localpaged.engine.kv_disk)
    kv_disk_bytes: int | str = 2 * 2**30  # the disk tier's size limit; least recently used blocks go first

    def __post_init__(self) -> None:
        self._check_types()
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device={self.device!r}: use 'auto', 'cpu' or 'cuda'")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={self.dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: use 'auto', 'float32' (the exact path), 'bfloat16' "
                "or 'float16' (16 bits halve the KV cache's memory; attention still computes in float32)"
            )
        if self.activations not in ("auto", "float32", "int16", "int8"):
            raise ConfigError(
                f"activations={self.activations!r}: use 'auto', 'float32' (the exact path), 'int16' or 'int8' "
                "(faster on a GGUF's blocks where the CPU has AVX-512 VNNI; each input row rounded to 16 or 8 bits)"
            )
        if self.weights not in ("auto", "float"):
            raise ConfigError(
                f"weights={self.weights!r}: use 'auto' (a GGUF's own blocks where the CPU kernels run) or 'float'"
            )
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ConfigError("kv_cache_memory must be positive")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs}: must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be at least 2")
        self.attention = self.attention or os.environ.get("LOCALPAGED_ATTENTION") or None
        if self.attention not in (None, "triton", "torch"):
            raise ConfigError(f"attention={self.attention!r}: use 'triton' or 'torch' (or LOCALPAGED_ATTENTION)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads={self.num_threads}: must be at least 1 (or None for torch's choice)")
        self.kv_disk_bytes = parse_bytes(self.kv_disk_bytes, "kv_disk_bytes")
        if self.kv_disk_bytes <= 0:
            raise ConfigError(
                f"kv_disk_bytes={self.kv_disk_bytes}: must be positive (turn the tier off with kv_disk=False)"
            )
        if self.block_size != BLOCK_SIZE:
            raise ConfigError(f"block_size is fixed at {BLOCK_SIZE}")

    def _check_types(self) -> None:
        """Each field's type, first: settings come from TOML, flags and callers, and a '4' for 4 would
        otherwise fail later as a TypeError far from the mistake (or, for a bool, pass as 1)."""
        kinds: dict[str, tuple[tuple[type, ...], bool, str]] = {
            "model": ((str, os.PathLike), True, "a path (str)"),
            "device": ((str,), False, "text, e.g. 'cpu'"),
            "dtype": ((str,), False, "text, e.g. 'float32'"),
            "weights": ((str,), False, "text, 'auto' or 'float'"),
            "kv_cache_dtype": ((str,), False, "text, e.g. 'bfloat16'"),
            "activations": ((str,), False, "text, 'auto', 'float32', 'int16' or 'int8'"),
            "max_num_seqs": ((int,), False, "a whole number"),
            "max_num_batched_tokens": ((int,), True, "a whole number"),
            "max_model_len": ((int,), True, "a whole number"),
            "enable_prefix_caching": ((bool,), False, "true or false"),
            "cascade_attention": ((bool,), False, "true or false"),
            "attention": ((str,), True, "text, 'triton' or 'torch'"),
            "enforce_eager": ((bool,), False, "true or false"),
            "num_threads": ((int,), True, "a whole number"),
            "block_size": ((int,), False, "a whole number"),
            "kv_disk": ((bool,), False, "true or false"),
        }
        for name, (types, optional, want) in kinds.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            wrong_bool = isinstance(value, bool) and bool not in types
            if wrong_bool or not isinstance(value, types):
                raise ConfigError(f"{name}={value!r} ({type(value).__name__}) must be {want}")
