"""Read a GGUF file's tensors under their Hugging Face names, keeping 32-weight quantised blocks as they are.

transformers' GGUF loader dequantises everything to float: right for the conversion cache and the
CUDA path, but on the CPU a decode step then reads four bytes per weight. Here Q4_0, Q4_1 and
Q8_0 tensors stay as ``BlockQuantized`` (an int8 per weight, a scale and a min per run of 32), for
the native CPU kernels; every other tensor is dequantised by gguf-py as transformers does. Q and K
projections of a "llama" file are un-permuted the same way transformers does it (a row permutation,
so it applies to quantised rows unchanged).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localpaged.kernels.cpu import QBLOCK

BLOCK_FIELDS = ("q", "scale", "minimum")


@dataclass
class BlockQuantized:
    """``weight[r, c] = scale[r, c // 32] * q[r, c] + minimum[r, c // 32]``, each step rounded to fp32."""

    q: torch.Tensor  # int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols / 32]
    minimum: torch.Tensor  # float32 [rows, cols / 32]

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 values gguf-py (and so transformers) gives: a product, then a sum, no FMA."""
        scale, minimum = (t.repeat_interleave(QBLOCK, dim=1) for t in (self.scale, self.minimum))
        return scale * self.q.float() + minimum

    def rows(self, index: torch.Tensor) -> BlockQuantized:
        return BlockQuantized(self.q[index], self.scale[index], self.minimum[index])

    @staticmethod
    def cat(parts: list[BlockQuantized]) -> BlockQuantized:
        return BlockQuantized(*(torch.cat([getattr(p, f) for p in parts]) for f in BLOCK_FIELDS))


def _unpack(data: np.ndarray, kind: str) -> BlockQuantized:
    """Raw GGUF bytes ``[rows, bytes_per_row]`` of a Q4_0/Q4_1/Q8_0 tensor -> BlockQuantized."""
    rows = data.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = data.reshape(-1, size)
    scale = blocks[:, 0:2].view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        q = blocks[:, 2:].view(np.int8)
        minimum = np.zeros_like(scale)
    else:
        packed = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8)  # low nibbles are the first 16
        if kind == "Q4_1":
            minimum = blocks[:, 2:4].view(np.float16).astype(np.float32)
        else:
            q, minimum = q - 8, np.zeros_like(scale)
    return BlockQuantized(
        torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)),
        torch.from_numpy(scale.reshape(rows, -1)),
        torch.from_numpy(minimum.reshape(rows, -1)),
    )


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of a Q or K projection."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def read_gguf(path: Path, hf_names: list[str], hf_config) -> dict[str, torch.Tensor | BlockQuantized]:
    """The tensors named in ``hf_names`` (Hugging Face names), quantised blocks kept where the type allows."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, hf_config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    out: dict[str, torch.Tensor | BlockQuantized] = {}
    for hf_name in hf_names:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            continue
        t = tensors[gguf_name]
        kind = t.tensor_type.name
        if kind in ("Q4_0", "Q4_1", "Q8_0"):
            value: torch.Tensor | BlockQuantized = _unpack(t.data, kind)
        else:
            value = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads}.get(
            gguf_name.split(".")[-2]
        )
        if arch == "llama" and heads and gguf_name.endswith(".weight"):
            perm = _unpermute_rows(t.data.shape[0], heads)
            value = value.rows(perm) if isinstance(value, BlockQuantized) else value[perm]
        out[hf_name] = value
    return out


def load_gguf_weights(gguf_path: Path, folder: Path, hf_config) -> dict[str, torch.Tensor | BlockQuantized]:
    """``read_gguf`` for every weight of the converted ``folder``, cached beside it after the first read.

    Parsing a GGUF's metadata (the whole vocabulary) takes seconds; the cached copy loads in a
    fraction of one. It is written atomically, so a killed start never leaves half a file.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cached = folder / "blocks.safetensors"
    if cached.is_file():
        return _unflatten(load_file(cached))
    names: list[str] = []
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(f, "pt") as st:
            names += list(st.keys())
    tensors = read_gguf(gguf_path, names, hf_config)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
    save_file(_flatten(tensors), tmp)
    os.replace(tmp, cached)
    return tensors


def _flatten(tensors: dict[str, torch.Tensor | BlockQuantized]) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if isinstance(value, BlockQuantized):
            flat.update({f"{name}:{part}": getattr(value, part).contiguous() for part in BLOCK_FIELDS})
        else:
            flat[name] = value.contiguous()
    return flat


def _unflatten(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | BlockQuantized]:
    out: dict[str, torch.Tensor | BlockQuantized] = {n: t for n, t in flat.items() if ":" not in n}
    for name in {n.partition(":")[0] for n in flat if ":" in n}:
        out[name] = BlockQuantized(*(flat[f"{name}:{part}"] for part in BLOCK_FIELDS))
    return out
