"""The native CPU kernels: compiled once with the system's C compiler, called through ctypes.

Like Triton on CUDA, the kernel source ships with the package and is built on first use, for the
instruction sets this CPU has (``cpu_isa``: AVX-512, AVX2 or portable C, or the one
``LOCALPAGED_CPU_KERNELS`` forces): the shared library lands in ``locations.kernels_cache_dir()``, in a
folder whose name hashes the sources, the flags and the compiler, so an edit, an upgrade or another
path builds its own and nothing else does. Before it is
loaded (dlopen runs its constructors) ``cache_folders.cached_folder`` checks that the folder and the
library are the user's and writable by no one else, and the library's sha256 against the one recorded
beside it at build time; a library failing either is rebuilt, never loaded. Builds happen in a private
folder renamed into place, so concurrent first starts neither race nor load a half-written file. It
links the OpenMP runtime that torch has already loaded (the same soname), so both share one thread
pool. Where no compiler, no 64-bit CPU or no working build is found, ``library()`` returns None and
callers use torch; a forced path this CPU cannot run is a ConfigError.

The ctypes boundary is checked on both sides, since a wrong pointer there is a crash or silently wrong
numbers rather than an exception: each wrapper checks the device, dtype, dimensions, layout and sizes
of what it passes (``KernelArgumentError`` naming the argument; real checks, not ``assert``, which
``python -O`` removes), and each C function returns a status that ``Kernel`` turns into an error (an
allocation that failed, an index outside the cache). The library reports its ``lp_abi_version()``; one
of another version is rebuilt once, and refused with a ``KernelError`` if a fresh build still differs.
Each binding's C signature is declared beside the wrapper that calls it.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localpaged.cache_folders import cached_folder, set_aside
from localpaged.errors import ConfigError, KernelArgumentError, KernelError
from localpaged.kernels import cpu_isa, torch_attention
from localpaged.kernels.cpu_isa import KernelPath, choose_path
from localpaged.locations import kernels_cache_dir

LIBRARY, HASH = "cpu_kernels.so", "cpu_kernels.so.sha256"  # in a folder named after the sources and flags
ABI_VERSION = 17  # what lp_abi_version() must report: cpu_kernels.h's LP_ABI_VERSION, bumped with it
TILE = 16  # weight rows per packed tile
PAGE = 16  # tokens per KV cache block, as the kernels index it
GROUPS = (32, 16)  # weights per scale/min run along a row: 32 for most GGUF types, 16 for Q6_K
BITS = (4, 5, 6, 8)  # packed widths of q (pack_blocks)
# How a packed weight's input rows are taken, in cpu_kernels.h's LP_ACT_* order: as they are (the exact path),
# rounded to int16 or to int8 per run (cpu_qgemm_int16.c, cpu_qgemm_int8.c).
ACTIVATIONS = ("float32", "int16", "int8")
# Statuses the kernels return (cpu_kernels.h's LP_* codes); any other is LP_BAD_ARGUMENT, sizes refused.
OK, OUT_OF_MEMORY, BAD_INDEX = 0, 1, 2
POINTER, SIZE, INT, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
INDEX_DTYPES = (torch.int32, torch.int64)  # block tables, lengths and slots: converted to what C reads
# KV cache element types the attention kernels of every path read and write (fp32 math on each), numbered as
# cpu_kernels.h's LP_KV_*.
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

KERNELS: list[Kernel] = []  # every binding, declared on the library when it loads


@functools.cache
def chosen_path() -> KernelPath:
    """The instruction-set path this process builds and loads (``cpu_isa.choose_path``), decided once."""
    return choose_path()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library of ``chosen_path()``, or None where it cannot run (see the module's docstring)."""
    # The kernels index with C longs and pass 64-bit pointers: a 32-bit process (or Windows' 32-bit long) cannot.
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_long) != 8:
        return None
    path = chosen_path()
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        warnings.warn(
            "no C compiler (gcc/cc) found: GGUF weights run dequantised through torch, ~2x slower", stacklevel=2
        )
        return None
    try:
        return _load(compiler, path)
    except (OSError, subprocess.CalledProcessError, ConfigError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(
            f"building the CPU kernels failed; GGUF weights run through torch instead:\n{detail}", stacklevel=2
        )
        return None


def runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype go to the native kernels: float32 on a CPU where they built."""
    return device.type == "cpu" and dtype == torch.float32 and library() is not None


def sources_sha256(path: KernelPath) -> str:
    """sha256 over the path's C files and flags: two libraries that may round differently never share it."""
    digest = hashlib.sha256()
    for source in path.inputs:
        digest.update(source.read_bytes())
    digest.update(" ".join(path.flags).encode())
    return digest.hexdigest()


@functools.cache
def pack_format() -> str:
    """sha256 over what lays out ``pack_blocks``' tensors: the C sources and flags in use, and this file. Weights kept
    packed on disk (models/packed_cache.py) are read back only by the same kernels: any change repacks once."""
    return hashlib.sha256((sources_sha256(chosen_path()) + Path(__file__).read_text()).encode()).hexdigest()


def _load(compiler: str, path: KernelPath) -> ctypes.CDLL:
    """The checked library built from ``path``'s sources by ``compiler``, loaded, of ABI_VERSION, kernels declared.

    A library whose sha256 matches its record may still be of another version (a cache folder copied
    from an older install); it is set aside and built again. A fresh build of another version means
    cpu.py and cpu_kernels.h disagree, which no rebuild mends: a KernelError.
    """
    folder = _library_folder(compiler, path)
    lib = ctypes.CDLL(str(folder / LIBRARY))
    reason = _abi_reason(lib)
    if reason is not None:
        # Unloaded first: dlopen of a path already loaded would hand back this library, not the rebuilt one.
        _ctypes.dlclose(lib._handle)
        set_aside(folder, reason)
        lib = ctypes.CDLL(str(_library_folder(compiler, path) / LIBRARY))
        reason = _abi_reason(lib)
        if reason is not None:
            raise KernelError(
                f"the CPU kernels just built from {path.source} are not the version kernels/cpu.py binds ({reason}); "
                "this installation of localpaged is inconsistent: reinstall it (a developer: bump ABI_VERSION "
                "in kernels/cpu.py and LP_ABI_VERSION in kernels/cpu_kernels.h together)"
            )
    for kernel in KERNELS:
        kernel.declare(lib)
    lib.lp_amx.argtypes, lib.lp_amx.restype = [ctypes.c_int], ctypes.c_int  # a number, not a status (see amx)
    return lib


def _abi_reason(lib: ctypes.CDLL) -> str | None:
    """Why ``lib`` is not the ABI this module binds (another ``lp_abi_version()``, or none), or None."""
    try:
        version = lib.lp_abi_version
    except AttributeError:
        return f"{LIBRARY} exports no lp_abi_version(): it predates the versioned interface"
    version.argtypes, version.restype = [], ctypes.c_int
    found = version()
    return (
        None if found == ABI_VERSION else f"{LIBRARY} reports ABI version {found}, kernels/cpu.py binds {ABI_VERSION}"
    )


def _library_folder(compiler: str, path: KernelPath) -> Path:
    """The cache folder holding ``path``'s library built by ``compiler``, checked, built here where needed."""
    digest = hashlib.sha256((sources_sha256(path) + compiler).encode()).hexdigest()[:16]
    return cached_folder(
        kernels_cache_dir() / f"cpu_kernels-{path.name}-{digest}", lambda f: _build(compiler, path, f), _hash_reason
    )


def _build(compiler: str, path: KernelPath, folder: Path) -> None:
    """Compile ``path``'s library into ``folder``, its sha256 recorded beside it (cache_folders publishes the folder).

    Each source compiles in a process of its own, all at once, then they link: the kernels' file takes the longest,
    and the other sources compile beside it instead of after it, so a first start waits less than for one compiler
    call over them all."""
    library_path = folder / LIBRARY
    objects = [folder / f"{source.stem}.o" for source in path.sources]
    compiles = [
        subprocess.Popen(
            [compiler, *path.flags, "-c", str(source), "-o", str(obj)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for source, obj in zip(path.sources, objects)
    ]
    failed = None
    for compile_ in compiles:
        out, err = compile_.communicate()
        if compile_.returncode and failed is None:
            failed = subprocess.CalledProcessError(compile_.returncode, compile_.args, out, err)
    if failed:
        raise failed
    command = [compiler, *path.flags, *map(str, objects), "-o", str(library_path)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    for obj in objects:
        obj.unlink()
    (folder / HASH).write_text(hashlib.sha256(library_path.read_bytes()).hexdigest())


def _hash_reason(folder: Path) -> str | None:
    """Why the library in ``folder`` is not the one built there (its sha256 differs from the one recorded), or None."""
    try:
        recorded = (folder / HASH).read_text().strip()
        actual = hashlib.sha256((folder / LIBRARY).read_bytes()).hexdigest()
    except OSError as exc:
        return f"cannot read {LIBRARY} or its recorded sha256 ({exc.strerror or exc})"
    return None if actual == recorded else f"{LIBRARY} does not match the sha256 recorded when it was built"


class Kernel:
    """One function the library exports: its C parameters, declared beside the wrapper that calls it.

    Every kernel returns a status; anything but OK raises here, so a failed allocation or an index
    outside the KV cache in C is a Python error rather than a crash or an unwritten output.
    """

    def __init__(self, name: str, argtypes: list[type], bad_index: str = "") -> None:
        self.name = name
        self.argtypes = argtypes
        self.bad_index = bad_index  # what LP_BAD_INDEX means for this kernel
        KERNELS.append(self)
        # A binding made after the library loaded (a model's, in a module imported later) is declared now:
        # called undeclared, ctypes would pass its pointers as C ints.
        if library.cache_info().currsize and (lib := library()) is not None:
            self.declare(lib)

    def declare(self, lib: ctypes.CDLL) -> None:
        """Give ``lib``'s function its C parameters and the int status it returns."""
        function = getattr(lib, self.name)
        function.argtypes, function.restype = self.argtypes, ctypes.c_int

    def __call__(self, *args: object) -> None:
        lib = library()
        if lib is None:
            raise KernelError(
                f"{self.name}: the native CPU kernels are not available on this machine; "
                "call them only where kernels.cpu.runs() is true"
            )
        status = getattr(lib, self.name)(*args)
        if status == OK:
            return
        if status == OUT_OF_MEMORY:
            raise KernelError(f"{self.name}: could not allocate its scratch memory; the machine is out of memory")
        if status == BAD_INDEX:
            raise KernelArgumentError(f"{self.name}: {self.bad_index}")
        raise KernelArgumentError(f"{self.name} rejected its sizes, bits or group (status {status})")


def expect(
    name: str, t: object, dtype: torch.dtype | tuple[torch.dtype, ...], dims: int | None, *, contiguous: bool = False
) -> None:
    """Raise KernelArgumentError naming ``name`` unless ``t`` is a CPU tensor of ``dtype`` (or one of several) with
    ``dims`` dimensions.

    ``contiguous`` where the kernel writes the tensor in place or the caller keeps it (caches, weights):
    a contiguous copy made here would read stale values or drop the writes. Inputs are copied instead.
    """
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if (
        isinstance(t, torch.Tensor)
        and t.is_cpu
        and t.dtype in dtypes
        and (dims is None or t.dim() == dims)
        and (t.is_contiguous() or not contiguous)
    ):
        return
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    problems = []
    if not t.is_cpu:
        problems.append(f"is on {t.device}, not the CPU")
    if t.dtype not in dtypes:
        problems.append(f"is {t.dtype}, not {' or '.join(map(str, dtypes))}")
    if dims is not None and t.dim() != dims:
        problems.append(f"has {t.dim()} dimensions {tuple(t.shape)}, not {dims}")
    if contiguous and not t.is_contiguous():
        problems.append("is not contiguous (the kernel reads or writes it in place: make it with .contiguous())")
    raise KernelArgumentError(f"{name} " + " and ".join(problems))


def expect_index(name: str, t: object, dims: int, rows: int) -> None:
    """Raise KernelArgumentError unless ``t`` is a CPU integer tensor of ``dims`` dimensions, ``rows`` long."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in INDEX_DTYPES and t.dim() == dims and len(t) == rows:
        return
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if not t.is_cpu or t.dtype not in INDEX_DTYPES:
        raise KernelArgumentError(f"{name} must be an int32 or int64 tensor on the CPU, not {t.dtype} on {t.device}")
    wanted = f"[{rows}]" if dims == 1 else f"[{rows}, ...] of {dims} dimensions"
    raise KernelArgumentError(f"{name} has shape {tuple(t.shape)}, expected {wanted}")


def _expect_cache(k_cache: object, v_cache: object) -> tuple[int, int, int, int]:
    """``(num_blocks, kv_heads, head_dim, kv_dtype)`` of caches ``[blocks, 16, KVH, D]`` of one of KV_DTYPES,
    written in place; ``kv_dtype`` is that type's number in KV_DTYPES, which picks the kernel's variant."""
    expect("k_cache", k_cache, KV_DTYPES, 4, contiguous=True)
    expect("v_cache", v_cache, KV_DTYPES, 4, contiguous=True)
    if v_cache.shape != k_cache.shape:
        raise KernelArgumentError(f"v_cache has shape {tuple(v_cache.shape)}, k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise KernelArgumentError(f"v_cache is {v_cache.dtype}, k_cache {k_cache.dtype}: one cache type for both")
    blocks, page, kv_heads, head_dim = k_cache.shape
    if page != PAGE:
        raise KernelArgumentError(
            f"k_cache holds blocks of {page} tokens; the CPU kernels read blocks of {PAGE}: "
            "[blocks, 16, kv_heads, head_dim]"
        )
    return blocks, kv_heads, head_dim, KV_DTYPES.index(k_cache.dtype)


def _expect_attention(q: object, k_cache: object, v_cache: object) -> tuple[int, int, int]:
    """``(num_blocks, kv_heads, kv_dtype)`` of the caches (see ``_expect_cache``) that float32 queries ``q``
    [rows, H, D] attend over: the same head_dim, a multiple of 8, and a whole number of query heads per KV head."""
    expect("q", q, torch.float32, 3)
    num_blocks, kv_heads, head_dim, kv_dtype = _expect_cache(k_cache, v_cache)
    rows, h, d = q.shape
    if d != head_dim or d % 8 or h % kv_heads:
        raise KernelArgumentError(
            f"q [{rows}, {h}, {d}] against caches of {kv_heads} KV heads of {head_dim}: need the same head_dim, "
            "a multiple of 8, and a whole number of query heads per KV head"
        )
    return num_blocks, kv_heads, kv_dtype


class Scales(ctypes.Structure):
    """cpu_kernels.h's lp_scales: a packed weight's scales and mins, each an fp16 unit times an int8 per group."""

    _fields_ = [
        ("unit", POINTER),
        ("mult", POINTER),
        ("min_unit", POINTER),
        ("min_mult", POINTER),
        ("unit_groups", SIZE),
    ]


PACKED_TENSORS = ("q", "unit", "mult", "min_unit", "min_mult")  # PackedBlocks' tensors (the last two may be None)


@dataclass(frozen=True)
class PackedBlocks:
    """A weight in the tile layout of cpu_qgemm.h: ``q`` in 8, 4, 5 or 6 bits a value; per group a scale and a min,
    each an fp16 unit (per ``unit_groups`` groups) times an int8 (cpu_scales.h).

    Checked once when made, so ``qgemm`` trusts its fields on every call.
    """

    q: torch.Tensor  # uint8 [tiles, bytes per tile]
    unit: torch.Tensor  # float16 [tiles, K/G/unit_groups, 16]
    mult: torch.Tensor  # int8 [tiles, K/G, 16]
    min_unit: torch.Tensor | None  # as unit; None where every min is 0 (Q4_0, Q5_0, Q8_0, Q6_K): nothing to add
    min_mult: torch.Tensor | None  # as mult; None with min_unit
    rows: int  # the weight's rows before padding to whole tiles
    bits: int  # 8 (int8 as is), 4, 5 or 6 (unsigned, stored as q + offset); for int8 activations: 4 or 8, unsigned
    offset: int
    group: int  # weights per scale/min run: one of GROUPS
    unit_groups: int  # groups per fp16 unit
    activations: str = "float32"  # one of ACTIVATIONS; "int8" is packed in quads (cpu_qgemm_int8.c)

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise KernelArgumentError(f"packed weights for {self.activations!r} activations: need one of {ACTIVATIONS}")
        widths = (4, 8) if self.activations == "int8" else BITS  # lp_pack_quads stores 5- and 6-bit values in 8 bits
        if self.bits not in widths or self.group not in GROUPS:
            raise KernelArgumentError(
                f"packed weights of {self.bits} bits in groups of {self.group}: need {widths}, {GROUPS}"
            )
        expect("q", self.q, torch.uint8, 2, contiguous=True)
        tiles, tile_bytes = self.q.shape
        cols = tile_bytes // (2 * self.bits)
        if tile_bytes != cols * 2 * self.bits or cols % self.group or not 0 <= tiles * TILE - self.rows < TILE:
            raise KernelArgumentError(
                f"q of shape {tuple(self.q.shape)} is not {self.rows} rows in tiles of {TILE} at {self.bits} bits"
            )
        groups = cols // self.group
        per = self.unit_groups
        if per < 1 or per & (per - 1) or groups % per or (self.min_unit is None) != (self.min_mult is None):
            raise KernelArgumentError(
                f"units of {per} groups over {groups} groups, a min's unit given {self.min_unit is not None} and "
                f"its multipliers {self.min_mult is not None}: need units of a power of two of groups that divide "
                "the groups, and both parts of a min or neither"
            )
        shapes = {"unit": (torch.float16, groups // self.unit_groups), "mult": (torch.int8, groups)}
        for name in ("unit", "mult", "min_unit", "min_mult"):
            value = getattr(self, name)
            if value is None:
                continue
            dtype, width = shapes[name.removeprefix("min_")]
            expect(name, value, dtype, 3, contiguous=True)
            if value.shape != (tiles, width, TILE):
                raise KernelArgumentError(f"{name} has shape {tuple(value.shape)}, not {(tiles, width, TILE)}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold this weight, by field name: PACKED_TENSORS less an absent min."""
        return {name: t for name in PACKED_TENSORS if (t := getattr(self, name)) is not None}

    @property
    def cols(self) -> int:
        """The weight's columns (the input features)."""
        return self.q.shape[1] // (2 * self.bits)

    @functools.cached_property
    def scales(self) -> Scales:
        """The lp_scales over this weight's tensors (which it keeps alive)."""

        def address(t: torch.Tensor | None) -> int | None:
            return t.data_ptr() if t is not None else None

        return Scales(
            address(self.unit), address(self.mult), address(self.min_unit), address(self.min_mult), self.unit_groups
        )


_lp_pack_q = Kernel("lp_pack_q", [POINTER, SIZE, SIZE, INT, INT, POINTER])


_lp_pack_quads = Kernel("lp_pack_quads", [POINTER, SIZE, SIZE, INT, INT, POINTER])


# Scale multipliers a block of each GGUF type lp_unpack_gguf reads (a K-quant's sub-block scales; a legacy type's one
# per block). The types' numbers and block sizes are gguf-py's, which the file reader uses too.
GGUF_MULTIPLIERS = {"Q4_0": 1, "Q4_1": 1, "Q5_0": 1, "Q5_1": 1, "Q8_0": 1, "Q4_K": 8, "Q5_K": 8, "Q6_K": 16}

_lp_unpack_gguf = Kernel("lp_unpack_gguf", [INT, POINTER, SIZE, POINTER, POINTER, POINTER, POINTER, POINTER])


def _gguf_blocks(raw: np.ndarray, kind: str, reader: str) -> int:
    """How many blocks of ``kind`` the rows of ``raw`` hold, once checked for ``reader``."""
    if not (isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.ndim == 2 and raw.flags.c_contiguous):
        raise KernelArgumentError(f"raw must be a C-ordered uint8 numpy array [rows, bytes a row], not {raw!r:.80}")
    if kind not in GGUF_MULTIPLIERS:
        raise KernelArgumentError(f"kind {kind!r}: {reader} reads {', '.join(GGUF_MULTIPLIERS)}")
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    if raw.shape[1] % size:
        raise KernelArgumentError(f"raw rows of {raw.shape[1]} bytes are not whole {kind} blocks of {size} bytes")
    return raw.shape[1] // size


def unpack_gguf(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, ...]:
    """A GGUF tensor's bytes ``raw`` (uint8 [rows, bytes a row], C order) of type ``kind`` (a GGUF_MULTIPLIERS key) ->
    ``(q, unit, mult, min_unit, min_mult)``, each [rows, ...]: the factors of models/gguf_weights.py's BlockQuantized,
    read in one native pass (``raw`` may be a view of the mapped file; it is only read)."""
    blocks = _gguf_blocks(raw, kind, "lp_unpack_gguf")
    weights = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    multipliers = GGUF_MULTIPLIERS[kind]
    rows = raw.shape[0]
    q = torch.empty(rows, blocks * weights, dtype=torch.int8)
    unit, min_unit = (torch.empty(rows, blocks, dtype=torch.float16) for _ in range(2))
    mult, min_mult = (torch.empty(rows, blocks * multipliers, dtype=torch.int8) for _ in range(2))
    pointers = (t.data_ptr() for t in (q, unit, mult, min_unit, min_mult))
    _lp_unpack_gguf(GGMLQuantizationType[kind].value, raw.ctypes.data, rows * blocks, *pointers)
    return q, unit, mult, min_unit, min_mult


_lp_dequantize_gguf = Kernel("lp_dequantize_gguf", [INT, POINTER, SIZE, POINTER])


def dequantize_gguf(raw: np.ndarray, kind: str) -> torch.Tensor:
    """``raw`` as ``unpack_gguf`` takes it -> its weights, float32 [rows, weights a row]: BlockQuantized.dequantize of
    its factors, to the bit, in one native call (a step's token embeddings: a few rows)."""
    blocks = _gguf_blocks(raw, kind, "lp_dequantize_gguf")
    out = torch.empty(raw.shape[0], blocks * GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0])
    _lp_dequantize_gguf(GGMLQuantizationType[kind].value, raw.ctypes.data, raw.shape[0] * blocks, out.data_ptr())
    return out


def vnni_is_fast() -> bool:
    """Whether ``qgemm`` with int16 or int8 activations runs a VNNI kernel here (else plain C: slow)."""
    return library() is not None and cpu_isa.VNNI_FLAGS <= cpu_isa.cpu_flags()


def int16_prefill_runs(head_dim: int) -> bool:
    """Whether ``paged_prefill``'s int16 products run here for heads of ``head_dim`` (else it is the float32 kernel):
    a CPU with AVX-512 VNNI and BF16, and heads of whole 16-float vectors."""
    return library() is not None and cpu_isa.PREFILL_INT16_FLAGS <= cpu_isa.cpu_flags() and head_dim % 16 == 0


def amx(want: bool | None = None) -> bool:
    """Whether cascade attention's shared pass runs on AMX tiles here, for a 16-bit KV cache and heads of a multiple
    of 32 values (else the float32 tile): a CPU with AMX-BF16 that Linux lets this process use. ``want`` False
    switches it off for this process (tests and benchmarks compare the two: ``amx_off``), True back on where it can
    run. Where it runs, the int16 prefill (``paged_prefill(..., "int16")``), a prompt's projections (``qgemm(...,
    prompt=True)``) and int16 projections of 16 rows or more (on AMX-INT8 tiles where the CPU has them, the same bits)
    run on AMX tiles too."""
    lib = library()
    return lib is not None and bool(lib.lp_amx(-1 if want is None else int(want)))


@contextlib.contextmanager
def amx_off() -> Iterator[None]:
    """The kernels without AMX tiles inside the ``with`` block, as every CPU without them runs (``amx``)."""
    was = amx()
    amx(False)
    try:
        yield
    finally:
        amx(was)


def amx_runs(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the AMX tiles run here for a cache of ``kv_dtype`` and heads of ``head_dim`` values (see ``amx``)."""
    return kv_dtype in (torch.float16, torch.bfloat16) and head_dim % 32 == 0 and amx()


def pack_blocks(
    q: torch.Tensor,
    unit: torch.Tensor,
    mult: torch.Tensor,
    min_unit: torch.Tensor,
    min_mult: torch.Tensor,
    activations: str = "float32",
) -> PackedBlocks:
    """Reorder ``q`` [N, K] int8 and its scales and mins into tiles of 16 rows (padded with zeros).

    A scale is ``unit`` [N, K/U] float16 times ``mult`` [N, K/G] int8 (U a multiple of G, G in GROUPS), a min
    ``min_unit`` times ``min_mult`` likewise: the factors a GGUF stores (models/gguf_weights.py).
    q is stored in as few bits as its range needs (shifted to start at 0): 4 for Q4_*'s 16 values (two
    columns share a byte: a row's value in column k in the low half, in column k+1 in the high), 5 for Q5_*'s 32 (the same
    nibbles and a plane of high bits), 6 for Q6_K's 64 (the nibbles and two high bits a column), else 8. A Q5_0 weight then costs 0.75 bytes with
    its scale instead of 1.25 as int8 with a scale and a zero min, a Q6_K one 0.81 instead of 1.06: decode reads every
    weight once per step. ``activations`` (one of ACTIVATIONS) says how ``qgemm`` takes X: float32 and int16 read this
    layout, int8 packs in cpu_qgemm_int8.c's quads, in 4 bits or else 8 (5- and 6-bit values too), every value shifted
    to start at 0.
    """
    expect("q", q, torch.int8, 2)
    for name, value, dtype in (
        ("unit", unit, torch.float16),
        ("mult", mult, torch.int8),
        ("min_unit", min_unit, torch.float16),
        ("min_mult", min_mult, torch.int8),
    ):
        expect(name, value, dtype, 2)
    n, k = q.shape
    groups, units = mult.shape[1], unit.shape[1]
    if (
        n == 0
        or groups == 0
        or units == 0
        or any(t.shape[0] != n for t in (unit, mult, min_unit, min_mult))
        or min_unit.shape != unit.shape
        or min_mult.shape != mult.shape
        or groups % units
    ):
        raise KernelArgumentError(
            f"q {tuple(q.shape)}, unit {tuple(unit.shape)}, mult {tuple(mult.shape)}, min_unit "
            f"{tuple(min_unit.shape)} and min_mult {tuple(min_mult.shape)}: need q [N, K] with N > 0, mult and "
            "min_mult [N, K / group], unit and min_unit [N, K / unit span], a span of whole groups"
        )
    group = k // groups
    if group not in GROUPS or k != group * groups:
        raise KernelArgumentError(
            f"q has {k} columns and mult {groups} groups: the CPU kernels take groups of {GROUPS} weights"
        )
    low, high = (int(v) for v in torch.aminmax(q))
    offset = -min(low, 0)
    if activations == "int8":
        bits = 4 if high + offset <= 15 else 8
    else:
        bits = next((b for b in BITS[:-1] if high + offset < 1 << b), 8)
        offset = offset if bits < 8 else 0
    tiles = -(-n // TILE)
    q = q.contiguous()
    packed = torch.empty(tiles, k * 2 * bits, dtype=torch.uint8)
    pack = _lp_pack_quads if activations == "int8" else _lp_pack_q
    pack(q.data_ptr(), n, k, bits, offset, packed.data_ptr())

    def tiled(t: torch.Tensor) -> torch.Tensor:  # [N, W] -> [tiles, W, 16], padded with zeros
        t = torch.cat([t, t.new_zeros(tiles * TILE - n, t.shape[1])])
        return t.reshape(tiles, TILE, t.shape[1]).transpose(1, 2).contiguous()

    has_min = bool(min_unit.any()) and bool(min_mult.any())
    return PackedBlocks(
        packed,
        tiled(unit),
        tiled(mult),
        tiled(min_unit) if has_min else None,
        tiled(min_mult) if has_min else None,
        n,
        bits,
        offset,
        group,
        groups // units,
        activations,
    )


_lp_qgemm = Kernel("lp_qgemm", [POINTER, SIZE, SIZE, POINTER, POINTER, SIZE, INT, INT, INT, POINTER])
_lp_qgemm_int16 = Kernel("lp_qgemm_int16", _lp_qgemm.argtypes)
_lp_qgemm_int8 = Kernel("lp_qgemm_int8", _lp_qgemm.argtypes)
_lp_qgemm_amx = Kernel("lp_qgemm_amx", _lp_qgemm.argtypes)
_QGEMM = {"float32": _lp_qgemm, "int16": _lp_qgemm_int16, "int8": _lp_qgemm_int8}  # by PackedBlocks.activations


def qgemm(x: torch.Tensor, w: PackedBlocks, prompt: bool = False) -> torch.Tensor:
    """``x`` [M, K] float32 times the packed weight's transpose: [M, rows]. ``x`` is copied if not contiguous.

    A weight packed for int16 or int8 activations goes to lp_qgemm_int16 or lp_qgemm_int8, which round each run of
    x to that width first. ``prompt`` says the rows are a prompt's: a weight packed for int16 activations then runs
    them on AMX tiles where those run (lp_qgemm_amx, as exact as int16 and much faster for many rows; each row's
    result is the same whatever the other rows), else as without."""
    expect("x", x, torch.float32, 2)
    if not isinstance(w, PackedBlocks):
        raise KernelArgumentError(f"w must be PackedBlocks (from pack_blocks), not {type(w).__name__}")
    x = x.contiguous()
    m, k = x.shape
    if k != w.cols:
        raise KernelArgumentError(f"x has {k} columns but the packed weight takes {w.cols} (x must be [M, {w.cols}])")
    padded = w.q.shape[0] * TILE
    out = torch.empty(m, padded)
    kernel = _lp_qgemm_amx if prompt and w.activations == "int16" else _QGEMM[w.activations]
    kernel(
        x.data_ptr(),
        m,
        k,
        w.q.data_ptr(),
        ctypes.addressof(w.scales),
        padded,
        w.bits,
        w.offset,
        w.group,
        out.data_ptr(),
    )
    return out if padded == w.rows else out[:, : w.rows]


class Cascade(ctypes.Structure):
    """cpu_kernels.h's lp_cascade: a ``torch_attention.CascadePlan``'s tensors, for one call."""

    _fields_ = [("num_groups", SIZE), ("group_starts", POINTER), ("members", POINTER), ("shared_lens", POINTER)]


def cascade_argument(plan: torch_attention.CascadePlan | None, batch: int) -> tuple[int | None, object]:
    """The address of an lp_cascade for ``plan`` (None: no plan) and what must outlive the call. The C side checks
    every value against the block tables; here only what it reads: int32 rows of lengths that agree."""
    if plan is None or len(plan.shared_lens) == 0:
        return None, None
    for name in ("group_starts", "members", "shared_lens"):
        expect(f"cascade.{name}", getattr(plan, name), (torch.int32,), 1, contiguous=True)
    starts, members, lens = plan.group_starts, plan.members, plan.shared_lens
    if len(starts) != len(lens) + 1 or int(starts[0]) != 0 or int(starts[-1]) != len(members):
        raise KernelArgumentError(
            f"cascade: {len(starts)} group starts from {int(starts[0])} to {int(starts[-1])} for {len(lens)} groups "
            f"and {len(members)} members: need groups + 1 of them, from 0 to the number of members"
        )
    if bool((starts[1:] <= starts[:-1]).any()) or len(members) > batch:
        raise KernelArgumentError("cascade: every group needs a member, and no more members than sequences")
    struct = Cascade(len(lens), starts.data_ptr(), members.data_ptr(), lens.data_ptr())
    return ctypes.addressof(struct), struct


_lp_paged_decode = Kernel(
    "lp_paged_decode",
    [POINTER, POINTER, POINTER, INT, POINTER, POINTER, SIZE, SIZE, SIZE, SIZE, SIZE, SIZE, FLOAT, POINTER, POINTER],
    bad_index="a context length is below 1, longer than its block table row, or a block id is outside the cache",
)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    cascade: torch_attention.CascadePlan | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context (as ``torch_attention.paged_decode``): ``q`` float32, the caches
    of any of KV_DTYPES (16-bit values are widened as they are read; the math is float32), the output float32.
    ``cascade`` groups sequences whose tables begin with the same blocks: those keys are read once for the group."""
    num_blocks, kv_heads, kv_dtype = _expect_attention(q, k_cache, v_cache)
    b, h, d = q.shape
    expect_index("block_tables", block_tables, 2, b)
    expect_index("context_lens", context_lens, 1, b)
    q, tables, lens = (
        q.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
    )
    out = torch.empty_like(q)
    plan, keep = cascade_argument(cascade, b)
    _lp_paged_decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv_dtype,
        tables.data_ptr(),
        lens.data_ptr(),
        b,
        h,
        kv_heads,
        d,
        tables.shape[1],
        num_blocks,
        scale,
        plan,
        out.data_ptr(),
    )
    del keep
    return out


_lp_paged_prefill = Kernel(
    "lp_paged_prefill",
    [*[POINTER] * 3, INT, *[POINTER] * 3, *[SIZE] * 7, FLOAT, POINTER, POINTER],
    bad_index=(
        "cu_seqlens_q does not rise from 0 to q's number of rows, a chunk is longer than its context, a context is "
        "longer than its block table row, or a block id is outside the cache"
    ),
)
_lp_paged_prefill_int16 = Kernel("lp_paged_prefill_int16", _lp_paged_prefill.argtypes, _lp_paged_prefill.bad_index)
_PREFILL = {"float32": _lp_paged_prefill, "int16": _lp_paged_prefill_int16}


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    activations: str = "float32",
    cascade: torch_attention.CascadePlan | None = None,
) -> torch.Tensor:
    """Varlen chunk attention over the paged cache (as ``torch_attention.paged_prefill``): ``q`` [num_q, H, D] float32,
    the rows of sequence b from ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1]``, each seeing its cached prefix and,
    causally, its own chunk; chunks of one query (decode rows) may sit beside longer ones. Caches of any of
    KV_DTYPES, read in place through ``block_tables`` (never gathered); the output is float32.

    ``activations="float32"`` computes in float32 (the exact path). ``"int16"`` runs the scores on int16-rounded
    q and K and the weighted sum on bfloat16 weights and V (``lp_paged_prefill_int16``, cpu_prefill_int16.c says
    what it rounds and why) where the CPU has AVX-512 VNNI and BF16, and in float32 elsewhere. ``cascade``: as for
    ``paged_decode``, each group's shared keys read (and rounded) once for all its members' rows."""
    if activations not in _PREFILL:
        raise KernelArgumentError(f"paged_prefill: activations={activations!r}: need one of {tuple(_PREFILL)}")
    num_blocks, kv_heads, kv_dtype = _expect_attention(q, k_cache, v_cache)
    num_q, h, d = q.shape
    expect("context_lens", context_lens, INDEX_DTYPES, 1)
    b = len(context_lens)
    expect_index("block_tables", block_tables, 2, b)
    expect_index("cu_seqlens_q", cu_seqlens_q, 1, b + 1)
    q, tables, cu, lens = (
        q.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        cu_seqlens_q.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
    )
    out = torch.empty_like(q)
    plan, keep = cascade_argument(cascade, b)
    _PREFILL[activations](
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv_dtype,
        tables.data_ptr(),
        cu.data_ptr(),
        lens.data_ptr(),
        num_q,
        b,
        h,
        kv_heads,
        d,
        tables.shape[1],
        num_blocks,
        scale,
        plan,
        out.data_ptr(),
    )
    del keep
    return out


_lp_add_rms_norm = Kernel("lp_add_rms_norm", [POINTER, POINTER, POINTER, SIZE, SIZE, FLOAT, POINTER, POINTER])


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` for float32 rows whose width is a multiple of 8."""
    expect("x", x, torch.float32, 2)
    expect("weight", weight, torch.float32, 1, contiguous=True)
    m, d = x.shape
    if d % 8 or weight.shape[0] != d:
        raise KernelArgumentError(f"x has rows of {d} and weight {weight.shape[0]}: need equal widths, a multiple of 8")
    if residual is not None:
        expect("residual", residual, torch.float32, 2)
        if residual.shape != x.shape:
            raise KernelArgumentError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}")
    x = x.contiguous()
    summed, out = torch.empty_like(x), torch.empty_like(x)
    res = residual.contiguous() if residual is not None else None
    _lp_add_rms_norm(
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


_lp_silu_mul = Kernel("lp_silu_mul", [POINTER, SIZE, SIZE, POINTER])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [M, 2I] (gate first), float32, I a multiple of 8."""
    expect("gate_up", gate_up, torch.float32, 2)
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    if two_i % 16:
        raise KernelArgumentError(f"gate_up has rows of {two_i}: need gate and up of a multiple of 8 each")
    out = gate_up.new_empty(m, two_i // 2)
    _lp_silu_mul(gate_up.data_ptr(), m, two_i // 2, out.data_ptr())
    return out


_lp_argmax_rows = Kernel("lp_argmax_rows", [POINTER, SIZE, SIZE, POINTER])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value, or of its first NaN, of float32 ``x`` [M, N], N > 0: what
    ``x.max(dim=-1).indices`` gives, int64 [M]."""
    expect("x", x, torch.float32, 2)
    x = x.contiguous()
    m, n = x.shape
    if n == 0:
        raise KernelArgumentError("x has rows of 0 values: an argmax needs at least one")
    out = torch.empty(m, dtype=torch.int64)
    _lp_argmax_rows(x.data_ptr(), m, n, out.data_ptr())
    return out


_lp_race_rows = Kernel("lp_race_rows", [POINTER, SIZE, SIZE, POINTER, POINTER, POINTER])


def race_rows(x: torch.Tensor, scale: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's winner of the sampler's exponential race over float32 ``x`` [M, N], N > 0 (``sampler.draw``): the
    index with the largest ``x * scale[row] - ln(E)``, E exponential draws made from ``keys[row]`` (int64) and the
    index; -1 for a row with a NaN or +inf after scaling, no value above -inf, or a scale not positive and finite.
    int64 [M]."""
    expect("x", x, torch.float32, 2)
    expect("scale", scale, torch.float32, 1)
    expect("keys", keys, torch.int64, 1)
    x, scale, keys = x.contiguous(), scale.contiguous(), keys.contiguous()
    m, n = x.shape
    if n == 0:
        raise KernelArgumentError("x has rows of 0 values: a draw needs at least one")
    if len(scale) != m or len(keys) != m:
        raise KernelArgumentError(f"scale has {len(scale)} and keys {len(keys)} values for {m} rows of x: one each")
    out = torch.empty(m, dtype=torch.int64)
    _lp_race_rows(x.data_ptr(), m, n, scale.data_ptr(), keys.data_ptr(), out.data_ptr())
    return out


_lp_nucleus_rows = Kernel("lp_nucleus_rows", [POINTER, SIZE, SIZE, POINTER, POINTER, POINTER, POINTER, POINTER])
UNDECIDED = -2  # nucleus_rows: the row's nucleus reaches past the values it looked at


def nucleus_rows(
    x: torch.Tensor, scale: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Each row's draw under top-k and top-p (``sampler.draw_rows``) over float32 ``x`` [M, N], N > 0: of its values
    ``x * scale[row]``, the ``top_k[row]`` largest (0: all), of those the likeliest that ``top_p[row]`` keeps (the
    smallest set, in descending order, whose share of their weight reaches it), and among them the winner of
    ``race_rows``' race with ``keys[row]``. -1 as ``race_rows`` (or a top_p outside (0, 1], a negative top_k);
    UNDECIDED where those reach past the 2,048 values nearest the row's largest. int64 [M]."""
    expect("x", x, torch.float32, 2)
    expect("scale", scale, torch.float32, 1)
    expect("top_p", top_p, torch.float32, 1)
    expect("top_k", top_k, torch.int64, 1)
    expect("keys", keys, torch.int64, 1)
    x, scale, top_p, top_k, keys = (t.contiguous() for t in (x, scale, top_p, top_k, keys))
    m, n = x.shape
    if n == 0:
        raise KernelArgumentError("x has rows of 0 values: a draw needs at least one")
    if not len(scale) == len(top_p) == len(top_k) == len(keys) == m:
        raise KernelArgumentError(
            f"scale has {len(scale)}, top_p {len(top_p)}, top_k {len(top_k)} and keys {len(keys)} values for {m} "
            "rows of x: one each"
        )
    out = torch.empty(m, dtype=torch.int64)
    _lp_nucleus_rows(
        x.data_ptr(), m, n, scale.data_ptr(), top_p.data_ptr(), top_k.data_ptr(), keys.data_ptr(), out.data_ptr()
    )
    return out


_lp_rope_write_kv = Kernel(
    "lp_rope_write_kv",
    [POINTER, POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, SIZE, SIZE, SIZE, POINTER, POINTER, INT, POINTER],
    bad_index="a slot_mapping entry is below -1 or past the end of the cache; its K/V was not written",
)


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

    ``cos``/``sin`` hold [N, R/2] values (any shape of that many, e.g. [N, 1, R/2]): the first R dimensions of
    each head rotate, the rest pass through (partial rotary; R = D rotates them all). Caches are
    ``[blocks, 16, KVH, D]`` of any of KV_DTYPES (rounded to nearest even, as ``Tensor.to`` rounds); D and R are
    multiples of 16.
    """
    num_blocks, kv_heads, d, kv_dtype = _expect_cache(k_cache, v_cache)
    expect("qkv", qkv, torch.float32, 2)
    expect("cos", cos, torch.float32, None)
    expect("sin", sin, torch.float32, None)
    n, width = qkv.shape
    if d % 16 or width != (num_heads + 2 * kv_heads) * d:
        raise KernelArgumentError(
            f"qkv has rows of {width}; {num_heads} query heads and caches of {kv_heads} KV heads of {d} "
            f"need rows of {(num_heads + 2 * kv_heads) * d}, and a head_dim that is a multiple of 16"
        )
    rotary = 2 * cos.numel() // n if n else d
    if (
        cos.dim() == 0
        or len(cos) != n
        or rotary % 16
        or rotary > d
        or cos.numel() * 2 != n * rotary
        or sin.shape != cos.shape
    ):
        raise KernelArgumentError(
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)}: need [{n}, R / 2] values each, one row a token, "
            f"R rotated dimensions a multiple of 16 and at most the head's {d}"
        )
    expect_index("slot_mapping", slot_mapping, 1, n)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q = qkv.new_empty(n, num_heads, d)
    _lp_rope_write_kv(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        n,
        num_heads,
        kv_heads,
        d,
        rotary,
        num_blocks * PAGE,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv_dtype,
        q.data_ptr(),
    )
    return q
