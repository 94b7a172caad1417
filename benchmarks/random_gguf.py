"""Write a random-weight GGUF: a model's shape with a longer context, or a popular model's shape under its tokenizer.

The default model holds 8,192 tokens and shared_prompt.py measures 30,000-token system prompts: this
writes a stand-in of the default model's shape with its context length raised (32,768 unless told)
and random weights in the source's own quantisation types, so that it runs at the real model's
speed (speed does not depend on the values; its text is noise). RoPE is left as it is: positions past
the trained context give other values, not other costs.

Each matrix is random normal values quantised to its type where gguf-py can quantise it (F32, F16,
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, ...); for the other types (the K formats) the source's own blocks
are shuffled, a valid encoding of other weights. One-dimensional tensors (norms, biases, RoPE
factors) are copied: they are a rounding error of the file and keep the activations' scale sane.

    python benchmarks/random_gguf.py SOURCE.gguf|default OUT.gguf [--context 32768] [--seed 0]

With ``--shape NAME`` it writes a model of another shape instead: the named shape's family (llama, qwen2 with
its Q/K/V biases, qwen3 with its Q/K norms and wider heads, phi3 with fused QKV and gate/up), dimensions and
vocabulary size, the source's tokenizer (a Llama-architecture source, the default model's SmolLM2-135M for
``default``) padded with unused tokens or cut to that size, and the tensor types of llama.cpp's quantisation mix
for ``--type`` (Q4_K_M unless told; Q5_K_M, Q6_K, Q8_0, Q4_0, F16), which ``llama-quantize`` gives the same shape.
Its blocks are written directly, random quant bits under scales chosen so that the dequantised weights are
~N(0, 0.02)-sized and finite, a tensor at a time (bounded memory); norms are ones, biases zeros. The context
length is the shape's own unless ``--context`` says otherwise.

    python benchmarks/random_gguf.py default OUT.gguf --shape qwen2.5-1.5b [--type Q4_K_M] [--context N]

With ``--deepen N`` it writes the source's own weights with N layers appended whose attention output and MLP
down projections are zeros (their other tensors copy the source's layers in turn): each adds nothing to the
residual stream, so the model answers exactly as the source does, at the cost of a deeper one. It is a target
for measuring a draft model's speed-up (``spec_decode.py --draft``) where no larger model of the draft's
vocabulary can be had offline: the source at another quantisation drafts for it.

    python benchmarks/random_gguf.py SOURCE.gguf OUT.gguf --deepen 270

The shapes (SHAPES) are the published bodies of the models they are named after; what they leave out costs
nothing at decode: the real tokenizers (a random model's text is noise in any), RoPE scaling factors (Llama 3.2's
and Phi's LongRoPE), biases' and norms' values.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    quantize,
)

WEIGHT_STD = 0.02  # as a freshly initialised transformers model's
PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
# Read from the source and written by GGUFWriter itself, or set below.
NOT_COPIED = ("GGUF.", "general.architecture", "general.alignment")


def random_matrix(tensor, rng: np.random.Generator) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """Random values of ``tensor``'s shape in its type: (the array to write, its raw type or None for plain)."""
    kind = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    values = (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float32)
    if kind in PLAIN:
        return values.astype(PLAIN[kind]), None
    try:
        return quantize(values, kind), kind
    except NotImplementedError:
        raw = np.array(tensor.data)
        blocks = raw.reshape(-1, GGML_QUANT_SIZES[kind][1])
        return rng.permutation(blocks).reshape(raw.shape), kind


def copy_fields(reader: GGUFReader, writer: GGUFWriter, changed: dict[str, int], note: str) -> None:
    """The source's metadata into ``writer`` (but what GGUFWriter writes itself), ``changed``'s values where it
    names a field, and ``note`` in brackets after the model's name."""
    for name, field in reader.fields.items():
        if name.startswith(NOT_COPIED):
            continue
        value = changed.get(name, field.contents())
        if name == "general.name":
            value = f"{value} ({note})"
        main = field.types[0]
        writer.add_key_value(name, value, main, field.types[-1] if main == GGUFValueType.ARRAY else None)


def write_random_gguf(source: Path, out: Path, context: int, seed: int = 0) -> Path:
    """``source``'s architecture, metadata and tokenizer with ``context`` as its context length, random weights."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    copy_fields(reader, writer, {f"{arch}.context_length": context}, f"random weights, context {context}")
    rng = np.random.default_rng(seed)
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if len(tensor.shape) == 1:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=None if kind in PLAIN else kind)
        else:
            data, raw_dtype = random_matrix(tensor, rng)
            writer.add_tensor(tensor.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


ZERO_OUTPUT = ("attn_output.weight", "ffn_down.weight")  # a block's writes to the residual stream


def write_deepened_gguf(source: Path, out: Path, extra_layers: int) -> Path:
    """``source`` with ``extra_layers`` blocks after its own that leave the residual stream as it is (zero output
    and down projections; their other tensors copy the source's blocks in turn)."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    layers = reader.fields[f"{arch}.block_count"].contents()
    writer = GGUFWriter(out, arch)
    copy_fields(
        reader, writer, {f"{arch}.block_count": layers + extra_layers}, f"+{extra_layers} layers adding nothing"
    )

    def add(name: str, tensor, zero: bool = False) -> None:
        kind = tensor.tensor_type
        data = np.zeros_like(tensor.data) if zero else np.array(tensor.data)  # zero bytes: 0.0 in every type
        writer.add_tensor(name, data, raw_dtype=None if kind in PLAIN else kind)

    blocks: dict[int, list] = {}
    for tensor in reader.tensors:
        match = re.match(r"blk\.(\d+)\.(.+)", tensor.name)
        if match:
            blocks.setdefault(int(match[1]), []).append((match[2], tensor))
        add(tensor.name, tensor)
    for i in range(extra_layers):
        for role, tensor in blocks[i % layers]:
            add(f"blk.{layers + i}.{role}", tensor, zero=role in ZERO_OUTPUT)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@dataclass(frozen=True)
class Shape:
    """A model body's dimensions and its family's tensor layout (``arch``: llama, qwen2, qwen3 or phi3)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int = 8192  # the trained context length, written unless --context is given
    rope_theta: float | None = None  # None: the source's
    size_label: str = ""
    arch: str = "llama"
    vocab: int | None = None  # None: the source tokenizer's; else its tokens padded or cut to it (resized_tokenizer)
    head_dim: int | None = None  # None: hidden // heads
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini); None: the whole head
    tied: bool = True  # the head is the token embedding (no output.weight)

    @property
    def head(self) -> int:
        return self.head_dim or self.hidden // self.heads


# Real models' bodies. Their published configs: Llama 3.2, Qwen2.5 and Qwen3 have tied heads over their own
# vocabularies (embedding rows, padded past the tokenizer as the models are); Phi-3.5-mini is written without its
# LongRoPE factors and Phi-4-mini without them too (a cost-free difference: RoPE's cost is the same).
SHAPES = {
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864, 32768, 1000000.0, "0.5B", "qwen2", 151936),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 3072, 40960, 1000000.0, "0.6B", "qwen3", 151936, head_dim=128),
    "smollm2-360m": Shape(960, 32, 15, 5, 2560, 8192, 100000.0, "360M"),
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 8192, 131072, 500000.0, "1B", vocab=128256),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 32768, 1000000.0, "1.5B", "qwen2", 151936),
    "smollm2-1.7b": Shape(2048, 24, 32, 32, 8192, 8192, 130000.0, "1.7B"),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 6144, 40960, 1000000.0, "1.7B", "qwen3", 151936, head_dim=128),
    "qwen2.5-3b": Shape(2048, 36, 16, 2, 11008, 32768, 1000000.0, "3B", "qwen2", 151936),
    "llama-3.2-3b": Shape(3072, 28, 24, 8, 8192, 131072, 500000.0, "3B", vocab=128256),
    "phi-3.5-mini": Shape(3072, 32, 32, 32, 8192, 131072, 10000.0, "3.8B", "phi3", 32064, tied=False),
    "phi-4-mini": Shape(3072, 32, 24, 8, 8192, 131072, 10000.0, "3.8B", "phi3", 200064, rotary_dim=96),
    "qwen3-4b": Shape(2560, 36, 32, 8, 9728, 40960, 1000000.0, "4B", "qwen3", 151936, head_dim=128),
}
# The type most matrices of a mix get (llama.cpp's default type for the file type).
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "F16": "F16"}
QK_K = 256  # a K-quant block's weights: rows of another length cannot hold K blocks
# llama.cpp's replacement for a K type on rows that are not a multiple of QK_K (llama-quant.cpp).
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
PAD_TOKEN_TYPE = 5  # llama.cpp's converter pads a vocabulary with "[PAD<id>]" tokens of type UNUSED


def block_roles(arch: str) -> tuple[str, ...]:
    """The tensors of one block of a model of family ``arch``, by their names in the block."""
    if arch == "phi3":  # fused QKV, and gate and up fused in ffn_up
        return (
            "attn_norm.weight",
            "attn_qkv.weight",
            "attn_output.weight",
            "ffn_norm.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        )
    extra = {
        "llama": (),
        "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
        "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
    }
    if arch not in extra:
        raise ValueError(f"no block layout for architecture {arch!r}: write one of llama, qwen2, qwen3, phi3")
    qkv = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight")
    return (
        qkv
        + extra[arch]
        + ("attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    )


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_type(name: str, columns: int, layers: int, mix: str, tied: bool) -> str:
    """The type llama.cpp's quantisation (llama_tensor_get_type) gives matrix ``name`` in file type ``mix``.

    The head (the token embedding where the head is tied to it) is Q6_K unless the mix is Q8_0; in
    Q4_K_M and Q5_K_M, attn_v (or a fused attn_qkv) and ffn_down are Q6_K in the layers ``use_more_bits``
    picks; K types on rows that are not a multiple of 256 fall back as
    llama.cpp's do (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0)."""
    kind = MIXES[mix]
    if kind == "F16":  # llama.cpp mixes only quantised file types
        return kind
    layer = re.match(r"blk\.(\d+)\.", name)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if kind != "Q8_0":
            kind = "Q6_K" if columns % QK_K == 0 else "Q8_0"
    elif (
        layer and mix in ("Q4_K_M", "Q5_K_M") and name.endswith(("attn_v.weight", "attn_qkv.weight", "ffn_down.weight"))
    ):
        kind = "Q6_K" if use_more_bits(int(layer.group(1)), layers) else kind
    if columns % QK_K:
        kind = K_FALLBACK.get(kind, kind)
    return kind


def _half_bytes(values: np.ndarray) -> np.ndarray:
    """float values [n] -> their float16 encodings as bytes [n, 2]."""
    return np.asarray(values, np.float16).reshape(-1, 1).view(np.uint8)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit sub-block scales and mins per block ``[n, 8]`` -> Q4_K/Q5_K's twelve bytes (ggml's get_scale_min_k4)."""
    sc, mn = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _rms_of_uniform(levels: int, centre: float) -> float:
    """The root mean square of ``q - centre`` for q uniform over 0..levels-1."""
    q = np.arange(levels, dtype=np.float64) - centre
    return float(np.sqrt(np.mean(q * q)))


def random_blocks(kind: str, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """``blocks`` blocks of ``kind`` as bytes ``[blocks, type size]``: random quant bits, and scale fields
    chosen so that the dequantised weights have a root mean square of WEIGHT_STD (finite by construction)."""
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    if kind in ("Q8_0", "Q4_0", "Q5_0"):  # w = d * (q - centre), one float16 d first
        spread = {"Q8_0": _rms_of_uniform(256, 128), "Q4_0": _rms_of_uniform(16, 8), "Q5_0": _rms_of_uniform(32, 16)}
        # q - centre averages -1/2: d's sign is random (as a quantiser's signed d is) so that no layer gets
        # a common offset in all its weights, which over many layers would drive every position alike.
        sign = rng.choice(np.array([-1.0, 1.0]), size=blocks)
        raw[:, 0:2] = _half_bytes(sign * WEIGHT_STD / spread[kind])
    elif kind == "Q5_1":  # w = d * q + m: m = -15.5 d centres q
        d = WEIGHT_STD / _rms_of_uniform(32, 15.5)
        raw[:, 0:2], raw[:, 2:4] = _half_bytes(np.full(blocks, d)), _half_bytes(np.full(blocks, -15.5 * d))
    elif kind in ("Q4_K", "Q5_K"):  # w = d * scale * q - dmin * min per sub-block of 32: min = scale, dmin centres q
        levels = 16 if kind == "Q4_K" else 32
        centre = (levels - 1) / 2
        scales = rng.integers(32, 64, size=(blocks, 8))
        d = WEIGHT_STD / (_rms_of_uniform(levels, centre) * np.sqrt(np.mean(scales.astype(np.float64) ** 2, axis=1)))
        raw[:, 0:2], raw[:, 2:4] = _half_bytes(d), _half_bytes(centre * d)
        raw[:, 4:16] = _pack_k_scales(scales, scales)
    elif kind == "Q6_K":  # w = d * scale * (q - 32) per sub-block of 16, signed 8-bit scales, d last
        scales = rng.integers(8, 17, size=(blocks, 16)) * rng.choice(np.array([-1, 1]), size=(blocks, 16))
        d = WEIGHT_STD / (_rms_of_uniform(64, 32) * np.sqrt(np.mean(scales.astype(np.float64) ** 2, axis=1)))
        raw[:, 192:208] = scales.astype(np.int8).view(np.uint8)
        raw[:, 208:210] = _half_bytes(d)
    else:
        raise ValueError(f"no random block writer for {kind} (have Q8_0 Q4_0 Q5_0 Q5_1 Q4_K Q5_K Q6_K)")
    return raw


def _tensor_dims(name: str, shape: Shape, vocab: int) -> tuple[int, ...]:
    """Tensor ``name``'s dimensions in ``shape``, numpy order (rows, columns), or (length,) for a norm or bias."""
    head = shape.head
    h, q, kv, inter = shape.hidden, shape.heads * head, shape.kv_heads * head, shape.intermediate
    role = re.sub(r"^blk\.\d+\.", "", name)
    dims = {
        "token_embd.weight": (vocab, h),
        "output.weight": (vocab, h),
        "output_norm.weight": (h,),
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_q_norm.weight": (head,),
        "attn_k_norm.weight": (head,),
        "attn_qkv.weight": (q + 2 * kv, h),
        "attn_output.weight": (h, q),
        "ffn_gate.weight": (inter, h),
        "ffn_up.weight": (2 * inter if shape.arch == "phi3" else inter, h),
        "ffn_down.weight": (h, inter),
    }
    if role not in dims:
        raise ValueError(f"{name}: not a tensor of the bodies reshaping writes; it knows {', '.join(dims)}")
    return dims[role]


def resized_tokenizer(reader: GGUFReader, vocab: int) -> dict[str, list]:
    """The source's tokens, token types and merges for a vocabulary of ``vocab`` entries: padded with
    "[PAD<id>]" tokens of type UNUSED as llama.cpp's converter pads a model's embedding rows past its
    tokenizer, or cut to the first ``vocab`` tokens and the merges that make only those."""
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    if vocab >= len(tokens):
        pad = range(len(tokens), vocab)
        return {
            "tokenizer.ggml.tokens": tokens + [f"[PAD{i}]" for i in pad],
            "tokenizer.ggml.token_type": types + [PAD_TOKEN_TYPE] * len(pad),
            "tokenizer.ggml.merges": merges,
        }
    kept = set(tokens[:vocab])

    def makes_kept(merge: str) -> bool:  # "a b": both parts and what they make are kept tokens
        a, b = merge.split(" ")
        return a in kept and b in kept and a + b in kept

    return {
        "tokenizer.ggml.tokens": tokens[:vocab],
        "tokenizer.ggml.token_type": types[:vocab],
        "tokenizer.ggml.merges": [m for m in merges if makes_kept(m)],
    }


def write_shaped_gguf(
    source: Path, out: Path, shape: Shape, mix: str = "Q4_K_M", context: int | None = None, seed: int = 0
) -> Path:
    """A GGUF of ``shape`` (its family's architecture and tensors) with ``source``'s tokenizer (resized to the
    shape's vocabulary) and general metadata, llama.cpp's ``mix`` of tensor types and random weights (norms
    are ones, biases zeros), written a tensor at a time."""
    if shape.heads % shape.kv_heads or (shape.head_dim is None and shape.hidden % shape.heads):
        raise ValueError(
            f"{shape}: the KV heads must divide the heads, and the heads the width unless head_dim is given"
        )
    roles = block_roles(shape.arch)
    reader = GGUFReader(source)
    source_arch = reader.fields["general.architecture"].contents()
    if source_arch != "llama":
        raise ValueError(f"{source}: architecture {source_arch!r}; reshaping takes its tokenizer from a Llama source")
    arch, vocab = shape.arch, shape.vocab or len(reader.fields["tokenizer.ggml.tokens"].contents())
    context = context or shape.context
    label = shape.size_label or f"{shape.layers}x{shape.hidden}"
    changed: dict[str, object] = {
        f"{arch}.embedding_length": shape.hidden,
        f"{arch}.block_count": shape.layers,
        f"{arch}.feed_forward_length": shape.intermediate,
        f"{arch}.attention.head_count": shape.heads,
        f"{arch}.attention.head_count_kv": shape.kv_heads,
        f"{arch}.context_length": context,
        f"{arch}.rope.dimension_count": shape.rotary_dim or shape.head,
        f"{arch}.vocab_size": vocab,
        "general.file_type": int(LlamaFileType[f"MOSTLY_{mix}"]),
        "general.size_label": label,
    }
    if shape.head_dim:
        changed[f"{arch}.attention.key_length"] = changed[f"{arch}.attention.value_length"] = shape.head_dim
    changed |= resized_tokenizer(reader, vocab)
    floats = {f"{arch}.rope.freq_base": shape.rope_theta} if shape.rope_theta is not None else {}
    writer = GGUFWriter(out, arch)
    for source_name, field in reader.fields.items():
        if source_name.startswith(NOT_COPIED):
            continue
        name = re.sub(r"^llama\.", f"{arch}.", source_name)
        value = changed.pop(name, floats.pop(name, field.contents()))
        if name == "general.name":  # not the family's name: llama.cpp gives named Phi-3 tokens attributes by it
            value = f"{value} reshaped to {label} (random weights, {mix})"
        main = field.types[0]
        writer.add_key_value(name, value, main, field.types[-1] if main == GGUFValueType.ARRAY else None)
    for name, value in changed.items():  # keys the source lacks
        if isinstance(value, str):
            writer.add_string(name, value)
        else:
            writer.add_uint32(name, value)
    for name, value in floats.items():
        writer.add_float32(name, value)

    order = ["token_embd.weight"] + [f"blk.{i}.{role}" for i in range(shape.layers) for role in roles]
    order += ["output_norm.weight"] + ([] if shape.tied else ["output.weight"])
    plan: list[tuple[str, tuple[int, ...], str]] = []
    for name in order:
        dims = _tensor_dims(name, shape, vocab)
        kind = "F32" if len(dims) == 1 else mix_type(name, dims[1], shape.layers, mix, shape.tied)
        plan.append((name, dims, kind))
        if kind in ("F32", "F16"):
            dtype = np.dtype(np.float32 if kind == "F32" else np.float16)
            writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
        else:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
            row_bytes = dims[1] // block * size
            writer.add_tensor_info(
                name, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes, GGMLQuantizationType[kind]
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in plan:  # a tensor's bytes at a time: memory is the largest tensor's
        if kind == "F32":  # RMSNorm weights as a fresh model's; biases zero
            data = (np.zeros if name.endswith(".bias") else np.ones)(dims, np.float32)
        elif kind == "F16":
            data = (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
        else:
            block = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
            data = random_blocks(kind, dims[0] * dims[1] // block, rng)
        writer.write_tensor_data(data)
        del data
    writer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "source", help="the GGUF whose shape (or, with --shape, tokenizer) to copy; 'default': the default model's"
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--context", type=int, help="the new context length (default 32768; with --shape, the shape's)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="write this shape instead of the source's")
    ap.add_argument("--type", choices=list(MIXES), default="Q4_K_M", help="with --shape: llama.cpp's type mix")
    ap.add_argument("--deepen", type=int, metavar="N", help="the source's weights and N layers that add nothing")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.source == "default":
        from localpaged.models.loader import default_model_path

        source = default_model_path()
    else:
        source = Path(args.source)
    start = time.perf_counter()
    if args.deepen:
        out = write_deepened_gguf(source, args.out, args.deepen)
    elif args.shape:
        out = write_shaped_gguf(source, args.out, SHAPES[args.shape], args.type, args.context, args.seed)
    else:
        out = write_random_gguf(source, args.out, args.context or 32768, args.seed)
    print(f"wrote {out} ({out.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
