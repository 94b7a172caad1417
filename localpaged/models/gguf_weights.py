"""A GGUF file's tensors under their Hugging Face names, quantised blocks kept as they are.

The eight types ``Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K`` (everything a ``Q4_K_M`` or ``Q5_K_M``
file is made of) stay as ``BlockQuantized``: an int8 per weight and a scale and min per run ("group")
of 32 weights, 16 for Q6_K, each kept as the file's fp16 times a small integer, whose fp32 products are
exactly the intermediate values gguf-py's dequantisation computes, for the native CPU kernels. Float tensors (F32, F16, BF16) are read as floats, and any
other type is dequantised by gguf-py once, with a one-line warning naming it. ``GGUFWeights`` reads
one tensor at a time, when the loader asks for it. Q and K projections of a "llama" file are
un-permuted the same way transformers does it (a row permutation, so it applies to quantised rows
unchanged).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localpaged.kernels import cpu
from localpaged.models.gguf_file import GGUFFile, TensorInfo

BLOCK_FIELDS = ("q", "unit", "mult", "min_unit", "min_mult")
FLOAT_TYPES = ("F32", "F16", "BF16")
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class BlockQuantized:
    """``weight[r, c] = scale[r, c // G] * q[r, c] + minimum[r, c // G]``, each step rounded to fp32; G = ``group``.

    A scale is kept as the file has it, an fp16 ``unit`` per run of U weights (a K-quant's block of 256, a legacy
    type's group) times an int8 ``mult`` per group; a min likewise. Their product is exact in fp32, the value gguf-py
    computes, and the native kernels read the two parts (kernels/cpu_scales.h: fewer bytes a decode step).
    """

    q: torch.Tensor  # int8 [rows, cols]
    unit: torch.Tensor  # float16 [rows, cols / U]
    mult: torch.Tensor  # int8 [rows, cols / G]
    min_unit: torch.Tensor  # float16 [rows, cols / U]
    min_mult: torch.Tensor  # int8 [rows, cols / G]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.mult.shape[1]

    @property
    def unit_groups(self) -> int:
        """Groups a unit serves."""
        return self.mult.shape[1] // self.unit.shape[1]

    def _product(self, unit: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
        return unit.float().repeat_interleave(self.unit_groups, dim=1) * mult.float()

    @property
    def scale(self) -> torch.Tensor:
        """float32 [rows, cols / G]."""
        return self._product(self.unit, self.mult)

    @property
    def minimum(self) -> torch.Tensor:
        """float32 [rows, cols / G]."""
        return self._product(self.min_unit, self.min_mult)

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 values gguf-py (and so transformers) gives: a product, then a sum, no FMA."""
        scale, minimum = (t.repeat_interleave(self.group, dim=1) for t in (self.scale, self.minimum))
        return scale * self.q.float() + minimum

    def regroup(self, group: int, unit_groups: int) -> BlockQuantized:
        """The same values with a scale and min per ``group`` weights (a divisor of this group) and a unit per
        ``unit_groups`` of those groups (a divisor of this unit's span): repeated."""
        unit_repeat = self.group * self.unit_groups // (group * unit_groups)
        mult_repeat = self.group // group
        return BlockQuantized(
            self.q,
            self.unit.repeat_interleave(unit_repeat, dim=1),
            self.mult.repeat_interleave(mult_repeat, dim=1),
            self.min_unit.repeat_interleave(unit_repeat, dim=1),
            self.min_mult.repeat_interleave(mult_repeat, dim=1),
        )

    @staticmethod
    def cat(parts: list[BlockQuantized]) -> BlockQuantized:
        """Rows of ``parts`` stacked; where their groups or units differ (a Q6_K V under Q4_K Q and K), on the
        smallest of each."""
        if len(parts) == 1:
            return parts[0]
        group = min(p.group for p in parts)
        span = min(p.group * p.unit_groups for p in parts)
        parts = [p.regroup(group, span // group) for p in parts]
        return BlockQuantized(*(torch.cat([getattr(p, f) for p in parts]) for f in BLOCK_FIELDS))


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes ``[..., 2]`` -> float16 ``[...]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray, runs: int) -> np.ndarray:
    """Bytes ``[blocks, runs * n]`` -> values ``[blocks, runs * 2n]``: each run of n bytes gives its n low
    nibbles, then its n high ones (the order of every ggml 4-bit layout)."""
    blocks = packed.reshape(packed.shape[0], runs, 1, -1)
    return ((blocks >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(packed.shape[0], -1)


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """Bytes ``[blocks, n]`` -> their four 2-bit fields ``[blocks, 4, n]``, lowest bits first."""
    return (packed[:, None, :] >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes of 6-bit sub-block scales and mins -> ``([blocks, 8], [blocks, 8])`` int8."""
    d, m, md = np.split(scales.reshape(-1, 3, 4), 3, axis=1)
    d, m, md = d[:, 0], m[:, 0], md[:, 0]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.int8), mn.astype(np.int8)


CHUNK_WEIGHTS = 1 << 20  # unpacked per numpy pass: its temporaries stay a few MB however large the tensor


def unpack(data: np.ndarray, kind: str) -> BlockQuantized:
    """Raw GGUF bytes ``[rows, bytes_per_row]`` of a NATIVE_TYPES tensor -> BlockQuantized.

    Scales and mins keep the file's factors: a K-quant's fp16 d and dmin per block and its sub-block integers, a
    legacy type's fp16 per group times 1. ``x - dmin * m`` becomes ``x + (-dmin) * m``, the same value in IEEE
    arithmetic. The native kernels' ``lp_unpack_gguf`` reads it in one pass where they are built; numpy, the
    reference it is tested against, a chunk of rows at a time elsewhere.
    """
    if cpu.library() is not None:
        return BlockQuantized(*cpu.unpack_gguf(np.ascontiguousarray(data), kind))
    step = max(1, CHUNK_WEIGHTS // (data.shape[1] * 2))  # at least 2 weights a byte
    first = unpack_numpy(data[:step], kind)
    if data.shape[0] <= step:
        return first
    # Each pass written into the full-size result: a load holds one unpacked weight, not its parts and their join.
    out = BlockQuantized(
        *(getattr(first, f).new_empty(data.shape[0], getattr(first, f).shape[1]) for f in BLOCK_FIELDS)
    )
    for start in range(0, data.shape[0], step):
        part = first if start == 0 else unpack_numpy(data[start : start + step], kind)
        for f in BLOCK_FIELDS:
            getattr(out, f)[start : start + step] = getattr(part, f)
    return out


def unpack_numpy(data: np.ndarray, kind: str) -> BlockQuantized:
    """``unpack`` in numpy, whole."""
    rows = data.shape[0]
    blocks = data.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])
    if kind in ("Q4_K", "Q5_K"):
        unit, min_unit = _half(blocks[:, 0:2])[:, None], -_half(blocks[:, 2:4])[:, None]
        mult, min_mult = _k_scales(blocks[:, 4:16])
        q = _nibbles(blocks[:, -128:], 4)
        if kind == "Q5_K":
            high = np.unpackbits(blocks[:, 16:48], axis=1, bitorder="little")  # bit b of byte j: run b's weight j
            q = q | (high.reshape(-1, 32, 8).transpose(0, 2, 1).reshape(q.shape) << 4)
    elif kind == "Q6_K":
        low = _nibbles(blocks[:, :128], 2)  # [blocks, 256]: two halves of 64 bytes -> 4 runs of 64 each
        high = _crumbs(blocks[:, 128:192].reshape(-1, 32)).reshape(-1, 256)
        q = (low | (high << 4)).astype(np.int8) - 32
        unit, mult = _half(blocks[:, 208:210])[:, None], blocks[:, 192:208].view(np.int8)
        min_unit, min_mult = np.zeros_like(unit), np.zeros_like(mult)
    else:
        unit = _half(blocks[:, 0:2])[:, None]
        with_min = kind in ("Q4_1", "Q5_1")
        min_unit = _half(blocks[:, 2:4])[:, None] if with_min else np.zeros_like(unit)
        mult, min_mult = np.ones(unit.shape, np.int8), np.full(unit.shape, int(with_min), np.int8)
        body = blocks[:, 4:] if with_min else blocks[:, 2:]
        if kind == "Q8_0":
            q = body.view(np.int8)
        elif kind in ("Q4_0", "Q4_1"):
            q = _nibbles(body, 1)
        else:  # Q5_0, Q5_1: 32 high bits as a little-endian word, then the nibbles
            q = _nibbles(body[:, 4:], 1) | (np.unpackbits(body[:, :4], axis=1, bitorder="little") << 4)
        q = q.astype(np.int8) - {"Q4_0": 8, "Q5_0": 16}.get(kind, 0)

    def rowwise(a: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(rows, -1))

    return BlockQuantized(
        rowwise(q, np.int8),
        rowwise(unit, np.float16),
        rowwise(mult, np.int8),
        rowwise(min_unit, np.float16),
        rowwise(min_mult, np.int8),
    )


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's rotary permutation of a Q or K projection."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


class GGUFWeights:
    """The tensors of a GGUF file that the model names (Hugging Face names), each read only when asked.

    A loader reads, packs and drops one weight at a time, and the file's pages of each tensor are handed
    back as soon as it is read (``GGUFFile.drop_pages``): the peak is then the packed model plus one
    tensor in flight, not every tensor unpacked at once on top of the whole mapped file.
    """

    def __init__(self, file: GGUFFile, hf_names: list[str], hf_config) -> None:
        import gguf

        self.file = file
        arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == file.architecture)
        name_map = gguf.get_tensor_name_map(arch_id, hf_config.num_hidden_layers)
        self.gguf_names = {
            hf_name: gguf_name
            for hf_name in hf_names
            if (gguf_name := name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))) in file.tensors
        }
        self._heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads}
        dequantized = {self.info(n).kind for n in self.gguf_names} - {*NATIVE_TYPES, *FLOAT_TYPES}
        if dequantized:
            warnings.warn(
                f"{file.path.name}: {', '.join(sorted(dequantized))} tensors have no native kernel here and are "
                f"dequantised to float at load (native: {', '.join(NATIVE_TYPES)})",
                stacklevel=2,
            )

    @property
    def names(self) -> list[str]:
        return list(self.gguf_names)

    def info(self, hf_name: str) -> TensorInfo:
        return self.file.tensors[self.gguf_names[hf_name]]

    def is_blocks(self, hf_name: str) -> bool:
        """Whether ``read`` gives this weight as BlockQuantized (a matrix of a NATIVE_TYPES type)."""
        info = self.info(hf_name)
        return info.kind in NATIVE_TYPES and len(info.shape) == 2

    def rows(self, hf_name: str) -> np.ndarray:
        """The tensor's raw bytes ``[rows, bytes_per_row]`` in Hugging Face row order (a view of the map where
        no rows move; llama Q and K rows are un-permuted as transformers does it, whole rows of blocks)."""
        gguf_name = self.gguf_names[hf_name]
        raw = self.file.raw(gguf_name)
        heads = self._heads.get(gguf_name.split(".")[-2])
        if self.file.architecture == "llama" and heads and gguf_name.endswith(".weight"):
            raw = raw[_unpermute_rows(raw.shape[0], heads)]
        return raw

    def read(self, hf_name: str) -> torch.Tensor | BlockQuantized:
        """The weight: blocks for NATIVE_TYPES matrices, else float32 (dequantised by gguf-py where quantised)."""
        import gguf

        info, raw = self.info(hf_name), self.rows(hf_name)
        if self.is_blocks(hf_name):
            value: torch.Tensor | BlockQuantized = unpack(raw, info.kind)
        else:
            values = gguf.dequantize(raw, gguf.GGMLQuantizationType[info.kind])
            value = torch.from_numpy(np.array(values, dtype=np.float32).reshape(info.shape))
        del raw
        self.file.drop_pages(self.gguf_names[hf_name])
        return value
