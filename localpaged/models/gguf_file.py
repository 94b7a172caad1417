"""A GGUF file opened as it is: its metadata, its tensor table, and each tensor's bytes memory-mapped.

gguf-py's ``GGUFReader`` turns every metadata value into numpy views, which for a 49152-token
vocabulary took seconds on every start; this reads the same layout (gguf-py's type constants and
block sizes) in a small fraction of that, walking the vocabulary and merge arrays without building
them (benchmarks/gguf_load.py times the start).
Tensor bytes are views into one read-only memory map: nothing is read until a tensor is unpacked,
a clean mapped page costs no swap, and ``drop_pages`` hands a tensor's pages back once it is packed
(they stay in the page cache; only this process's resident set shrinks). Every way a file can be broken (empty, foreign, truncated,
an unknown tensor type) is one InvalidModelError naming the file and what was found.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from localpaged.errors import InvalidModelError

VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays: llama.cpp writes none deeper than 2
SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first
    kind: str  # the ggml type's name: "Q4_K", "F32", ...
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """``metadata`` (key -> value), ``tensors`` (name -> TensorInfo) and ``raw(name)``: a tensor's bytes as
    ``[rows, bytes_per_row]`` uint8, a view of the memory-mapped file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        except ValueError as exc:  # an empty file cannot be mapped
            raise self.invalid("it is empty") from exc
        except OSError as exc:
            raise self.invalid(f"it cannot be read: {exc}") from exc
        self._pos = 4  # past the magic bytes
        try:
            self._parse()
        except InvalidModelError:
            raise
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as exc:
            raise self.invalid(f"its header is cut short or corrupt ({type(exc).__name__}: {exc})") from exc

    def invalid(self, why: str) -> InvalidModelError:
        return InvalidModelError(
            f"{self.path} is not a valid GGUF file: {why}; download it again, or pass another --model"
        )

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        data = self._map[info.offset : info.offset + info.nbytes]
        return data.reshape(-1, info.nbytes // max(1, int(np.prod(info.shape[:-1], dtype=np.int64))))

    def drop_pages(self, name: str) -> None:
        """Unmap the pages of tensor ``name`` from this process once it is unpacked (a later read maps them again).

        Read pages of a mapped file count in the resident set until unmapped: without this a load keeps
        the whole file resident on top of the packed weights.
        """
        info = self.tensors[name]
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        self._mmap.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

    def _parse(self) -> None:
        if bytes(self._map[:4]) != b"GGUF":
            raise self.invalid("it does not start with the GGUF magic bytes")
        version, tensor_count, kv_count = self._unpack("<IQQ")
        if version not in VERSIONS:
            raise self.invalid(f"it is GGUF version {version}; versions {' and '.join(map(str, VERSIONS))} are read")
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.metadata[key] = self._value(value_type)
        if "general.architecture" not in self.metadata:
            raise self.invalid("its metadata has no general.architecture")
        table = []
        for _ in range(tensor_count):
            name = self._string()
            (dims,) = self._unpack("<I")
            if not 1 <= dims <= MAX_DIMS:
                raise self.invalid(f"tensor {name} has {dims} dimensions; a ggml tensor has 1 to {MAX_DIMS}")
            shape = tuple(reversed(self._unpack(f"<{dims}Q")))
            type_id, offset = self._unpack("<IQ")
            table.append((name, shape, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        size = len(self._map)
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in table:
            try:
                kind = GGMLQuantizationType(type_id)
            except ValueError:
                raise self.invalid(f"tensor {name} has ggml type {type_id}, which gguf-py does not know") from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(shape, dtype=np.int64))
            if shape[-1] % block:
                raise self.invalid(f"tensor {name} of shape {shape} does not divide into {kind.name} blocks of {block}")
            info = TensorInfo(name, shape, kind.name, data_start + offset, elements // block * block_bytes)
            if info.offset + info.nbytes > size:
                raise self.invalid(f"tensor {name} runs past the end of the file ({size} bytes): it is truncated")
            self.tensors[name] = info

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start, self._pos = self._pos, self._pos + length
        if self._pos > len(self._map):
            raise ValueError("a string runs past the end of the file")
        return bytes(self._map[start : self._pos]).decode("utf-8")

    def _value(self, value_type: int, depth: int = 0) -> object:
        """A metadata value; an array of strings (the vocabulary, the merges) is walked and kept as its length:
        the tokenizer is built by transformers from the file, and a config needs only the count. Arrays nest
        at most MAX_ARRAY_DEPTH deep: a crafted file nesting thousands deep would end in a RecursionError."""
        if value_type in SCALARS:
            return self._unpack(SCALARS[value_type])[0]
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {value_type}")
        item_type, count = self._unpack("<IQ")
        if item_type in SCALARS:
            return list(self._unpack(f"<{count}{SCALARS[item_type][1]}"))
        if item_type != GGUFValueType.STRING:
            if item_type == GGUFValueType.ARRAY and depth >= MAX_ARRAY_DEPTH:
                raise self.invalid(f"its metadata nests arrays more than {MAX_ARRAY_DEPTH} deep")
            return [self._value(item_type, depth + 1) for _ in range(count)]
        for _ in range(count):
            (length,) = self._unpack("<Q")
            self._pos += length
        return count
