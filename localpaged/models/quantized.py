"""Projections and embeddings whose weights stay in a GGUF's blocks (runs of 32 or 16 weights), for the CPU.

``swap_in_blocks`` replaces each projection of a loaded model whose weights the file stored as
blocks with a ``BlockLinear`` (layers/linear.py: native kernel, 0.6-1.1 bytes a weight instead of 4)
and the token embedding with a ``BlockEmbedding`` (rows unpacked from the mapped file as tokens need
them; it stays here, beside the loader, because it decodes the GGUF's own bytes);
everything else loads as floats. The values used are exactly the fp32 ones a float32 load would
hold, so greedy output still matches Hugging Face's float32 run.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from localpaged.kernels import cpu
from localpaged.layers.linear import BlockLinear
from localpaged.models.gguf_weights import BlockQuantized, GGUFWeights, unpack
from localpaged.models.packed_cache import PackedCache


class BlockEmbedding(nn.Module):
    """Token embeddings read from the GGUF's own bytes: a step unpacks only the rows of its tokens.

    A lookup touches a few rows (a decode step one per sequence), so no unpacked copy of the vocabulary
    is kept: for the default model that copy (an int8 a weight) is about the packed head's size again.
    """

    def __init__(self, rows: np.ndarray, kind: str) -> None:
        super().__init__()
        self.rows = rows  # [vocab, bytes_per_row], a view of the memory-mapped file
        self.kind = kind

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows[ids.numpy()]
        if cpu.library() is not None:  # one native call, not a dozen torch ops on a few rows
            return cpu.dequantize_gguf(rows, self.kind)
        return unpack(rows, self.kind).dequantize()


def swap_in_blocks(
    model: nn.Module, weights: GGUFWeights, activations: str = "float32", cache: PackedCache | None = None
) -> dict[str, torch.Tensor]:
    """Put block modules in ``model`` where every shard of a weight is blocks; return the float tensors to load.

    A projection ``cache`` holds (packed at an earlier start) is mapped from it; any other is read, packed and
    dropped before the next is read, the tall head first (its unpacked form is the largest thing a load holds), so
    a load peaks at the packed model plus one weight, and what was packed is written to ``cache`` for later starts.
    """
    tied = model.config.tie_word_embeddings or "lm_head.weight" not in weights.gguf_names
    cached = cache.load() if cache is not None else {}
    packs: dict[str, cpu.PackedBlocks] = {}
    fresh = 0  # projections packed here, not mapped from the cache
    consumed: set[str] = set()
    modules = sorted(model.named_modules(), key=lambda item: item[0] != "lm_head")
    for name, module in modules:
        parent, _, leaf = name.rpartition(".")
        if leaf == "embed_tokens":
            hf = ["model.embed_tokens.weight"]
        elif leaf == "lm_head":
            hf = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        elif isinstance(module, nn.Linear):
            hf = [f"model.{parent}.{shard}.weight" for shard in model.fused.get(leaf, (leaf,))]
        else:
            continue
        if not all(n in weights.gguf_names and weights.is_blocks(n) for n in hf):
            continue
        if leaf == "embed_tokens":
            new: nn.Module = BlockEmbedding(weights.rows(hf[0]), weights.info(hf[0]).kind)
        else:
            pack = cached.pop(name, None)
            expected = (module.out_features, module.in_features, activations)
            if pack is None or (pack.rows, pack.cols, pack.activations) != expected:
                fresh += 1
                blocks = BlockQuantized.cat([weights.read(n) for n in hf])
                pack = cpu.pack_blocks(
                    blocks.q, blocks.unit, blocks.mult, blocks.min_unit, blocks.min_mult, activations
                )
                del blocks  # the unpacked weight goes before the next one is read
            packs[name] = pack
            new = BlockLinear(pack, module.bias)
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        consumed.update(hf)
    if cache is not None and (fresh or cached):
        if fresh < len(packs) or cached:  # it packed some projections otherwise, or holds others: not this model's
            cache.set_aside("it does not hold this model's projections as they are packed now")
        cache.save(packs)
    # A block shard nobody took (its projection's other shards are floats) loads as floats.
    floats = {}
    for name in weights.names:
        if name not in consumed:
            value = weights.read(name)
            floats[name] = value.dequantize() if isinstance(value, BlockQuantized) else value
    return floats
