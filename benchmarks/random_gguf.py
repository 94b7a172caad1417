"""Write a random-weight GGUF of a model's shape: its architecture, tokenizer and metadata, a longer context.

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
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quantize

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


def write_random_gguf(source: Path, out: Path, context: int, seed: int = 0) -> Path:
    """``source``'s architecture, metadata and tokenizer with ``context`` as its context length, random weights."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith(NOT_COPIED):
            continue
        value = field.contents()
        if name == f"{arch}.context_length":
            value = context
        elif name == "general.name":
            value = f"{value} (random weights, context {context})"
        main = field.types[0]
        writer.add_key_value(name, value, main, field.types[-1] if main == GGUFValueType.ARRAY else None)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="the GGUF whose shape to copy; 'default': the default model's")
    ap.add_argument("out", type=Path)
    ap.add_argument("--context", type=int, default=32768, help="the new context length (default 32768)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.source == "default":
        from localpaged.models.loader import default_model_path

        source = default_model_path()
    else:
        source = Path(args.source)
    print(f"wrote {write_random_gguf(source, args.out, args.context, args.seed)}")


if __name__ == "__main__":
    main()
