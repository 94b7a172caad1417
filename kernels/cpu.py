"""The native CPU kernels (cpu_kernels.c): compiled once with the system's C compiler, called through ctypes.

Like Triton on CUDA, the kernel source ships with the package and is built on first use: the
shared library lands in ``locations.kernels_cache_dir()``, in a folder whose name hashes the source,
the flags and the compiler, so an edit or an upgrade rebuilds it and nothing else does. Before it is
loaded (dlopen runs its constructors) ``cache_folders.cached_folder`` checks that the folder and the
library are the user's and writable by no one else, and the library's sha256 against the one recorded
beside it at build time; a library failing either is rebuilt, never loaded. Builds happen in a private
folder renamed into place, so concurrent first starts neither race nor load a half-written file. It
links the OpenMP runtime that torch has already loaded (the same soname), so both share one thread
pool. Where no compiler, no x86-64 AVX2 CPU or no working build is found, ``library()`` returns None
and callers use torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from localpaged.cache_folders import cached_folder
from localpaged.errors import ConfigError
from localpaged.locations import kernels_cache_dir

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBRARY, HASH = "cpu_kernels.so", "cpu_kernels.so.sha256"  # in a folder named after the source and flags
TILE = 16  # weight rows per packed tile
GROUPS = (32, 16)  # weights per scale/min run along a row: 32 for most GGUF types, 16 for Q6_K


@functools.cache
def library() -> ctypes.CDLL | None:
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2",
        "AVX512",
    ):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        warnings.warn(
            "no C compiler (gcc/cc) found: GGUF weights run dequantised through torch, ~2x slower", stacklevel=2
        )
        return None
    try:
        folder = _library_folder(compiler)
    except (OSError, subprocess.CalledProcessError, ConfigError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(
            f"building the CPU kernels failed; GGUF weights run through torch instead:\n{detail}", stacklevel=2
        )
        return None
    lib = ctypes.CDLL(str(folder / LIBRARY))
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.lp_qgemm.argtypes = [p, n, n, p, p, p, n, ctypes.c_int, ctypes.c_int, ctypes.c_int, p]
    lib.lp_qgemm.restype = None
    lib.lp_pack_q.argtypes = [p, n, n, ctypes.c_int, ctypes.c_int, p]
    lib.lp_pack_q.restype = None
    lib.lp_paged_decode.argtypes = [p, p, p, p, p, n, n, n, n, n, ctypes.c_float, p]
    lib.lp_paged_decode.restype = None
    lib.lp_add_rms_norm.argtypes = [p, p, p, n, n, ctypes.c_float, p, p]
    lib.lp_add_rms_norm.restype = None
    lib.lp_silu_mul.argtypes = [p, n, n, p]
    lib.lp_silu_mul.restype = None
    lib.lp_rope_write_kv.argtypes = [p, p, p, p, n, n, n, n, p, p, p]
    lib.lp_rope_write_kv.restype = None
    return lib


def runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype go to the native kernels: float32 on a CPU where they built."""
    return device.type == "cpu" and dtype == torch.float32 and library() is not None


def _library_folder(compiler: str) -> Path:
    """The cache folder holding the library built from SOURCE by ``compiler``, checked, built here where needed."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    return cached_folder(kernels_cache_dir() / f"cpu_kernels-{digest}", lambda f: _build(compiler, f), _hash_reason)


def _build(compiler: str, folder: Path) -> None:
    """Compile the library into ``folder`` and record its sha256 beside it (cache_folders publishes the folder)."""
    library_path = folder / LIBRARY
    subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(library_path)], check=True, capture_output=True, text=True)
    (folder / HASH).write_text(hashlib.sha256(library_path.read_bytes()).hexdigest())


def _hash_reason(folder: Path) -> str | None:
    """Why the library in ``folder`` is not the one built there (its sha256 differs from the one recorded), or None."""
    try:
        recorded = (folder / HASH).read_text().strip()
        actual = hashlib.sha256((folder / LIBRARY).read_bytes()).hexdigest()
    except OSError as exc:
        return f"cannot read {LIBRARY} or its recorded sha256 ({exc.strerror or exc})"
    return None if actual == recorded else f"{LIBRARY} does not match the sha256 recorded when it was built"


@dataclass
class PackedBlocks:
    """A weight in the tile layout of cpu_kernels.c: ``q`` in 8, 4 or 5 bits a value, fp32 scale and min per group."""

    q: torch.Tensor  # uint8/int8 [tiles, bytes per tile]
    scale: torch.Tensor
    minimum: torch.Tensor | None  # None where every min is 0 (Q4_0, Q5_0, Q8_0, Q6_K): nothing to read or add
    rows: int  # the weight's rows before padding to whole tiles
    bits: int  # 8 (int8 as is), 4 or 5 (unsigned, stored as q + offset)
    offset: int
    group: int  # weights per scale/min run: one of GROUPS


def pack_blocks(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> PackedBlocks:
    """Reorder ``q`` [N, K] int8 and ``scale``/``minimum`` [N, K/G] (G in GROUPS) into tiles of 16 rows (padded with zeros).

    q is stored in as few bits as its range needs (shifted to start at 0): 4 for Q4_*'s 16 values (two
    rows share a byte: row j's in the low half, row j+8's in the high), 5 for Q5_*'s 32 (the same
    nibbles and a plane of high bits), else 8. A Q5_0 weight then costs 0.75 bytes with its scale
    instead of 1.25 as int8 with a scale and a zero min: decode reads every weight once per step.
    """
    n, k = q.shape
    group = k // scale.shape[1]
    assert group in GROUPS and k == group * scale.shape[1], (q.shape, scale.shape)
    low, high = (int(v) for v in torch.aminmax(q))
    offset = -min(low, 0)
    bits = 4 if high + offset <= 15 else 5 if high + offset <= 31 else 8
    offset = offset if bits < 8 else 0
    tiles = -(-n // TILE)
    q = q.contiguous()
    packed = torch.empty(tiles, k * 2 * bits, dtype=torch.uint8)
    library().lp_pack_q(q.data_ptr(), n, k, bits, offset, packed.data_ptr())

    def tiled(t: torch.Tensor) -> torch.Tensor:  # [N, K/G] -> [tiles, K/G, 16], padded with zeros
        t = torch.cat([t.float(), t.new_zeros(tiles * TILE - n, t.shape[1], dtype=torch.float32)])
        return t.reshape(tiles, TILE, t.shape[1]).transpose(1, 2).contiguous()

    minimum = tiled(minimum) if bool(minimum.any()) else None
    return PackedBlocks(packed, tiled(scale), minimum, n, bits, offset, group)


def qgemm(x: torch.Tensor, w: PackedBlocks) -> torch.Tensor:
    """``x`` [M, K] float32 times the packed weight's transpose: [M, rows]."""
    x = x.contiguous()
    m, k = x.shape
    padded = w.q.shape[0] * TILE
    assert w.q.shape[1] == k * 2 * w.bits and k % w.group == 0 and x.dtype == torch.float32, (x.shape, x.dtype, w)
    out = torch.empty(m, padded)
    library().lp_qgemm(
        x.data_ptr(),
        m,
        k,
        w.q.data_ptr(),
        w.scale.data_ptr(),
        w.minimum.data_ptr() if w.minimum is not None else None,
        padded,
        w.bits,
        w.offset,
        w.group,
        out.data_ptr(),
    )
    return out if padded == w.rows else out[:, : w.rows]


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged context (as ``reference.paged_decode``), float32 only."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    assert q.dtype == k_cache.dtype == torch.float32 and d % 8 == 0 and h % kvh == 0 and k_cache.shape[1] == 16
    q, tables, lens = (
        q.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
    )
    out = torch.empty_like(q)
    library().lp_paged_decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        b,
        h,
        kvh,
        d,
        tables.shape[1],
        scale,
        out.data_ptr(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` for float32 rows whose width is a multiple of 8."""
    x = x.contiguous()
    m, d = x.shape
    summed, out = torch.empty_like(x), torch.empty_like(x)
    res = residual.contiguous() if residual is not None else None
    library().lp_add_rms_norm(
        x.data_ptr(),
        res.data_ptr() if res is not None else None,
        weight.data_ptr(),
        m,
        d,
        eps,
        summed.data_ptr(),
        out.data_ptr(),
    )
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [M, 2I] (gate first), float32, I a multiple of 8."""
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    out = gate_up.new_empty(m, two_i // 2)
    library().lp_silu_mul(gate_up.data_ptr(), m, two_i // 2, out.data_ptr())
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """RoPE on q and k of ``qkv`` [N, (H + 2 KVH) * D], k and v stored in their slots; returns rotated q [N, H, D].

    ``cos``/``sin`` hold [N, D/2] values; caches are float32 ``[blocks, 16, KVH, D]``, D a multiple of 16.
    """
    n = qkv.shape[0]
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q = qkv.new_empty(n, num_heads, d)
    library().lp_rope_write_kv(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        n,
        num_heads,
        kvh,
        d,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        q.data_ptr(),
    )
    return q
