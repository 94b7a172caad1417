"""Projections and embeddings whose weights stay in a GGUF's blocks (runs of 32 or 16 weights), for the CPU.

``swap_in_blocks`` replaces each projection of a loaded model whose weights the file stored as
blocks with a ``BlockLinear`` (native kernel, 0.75-1.5 bytes a weight instead of 4) and the token
embedding with a ``BlockEmbedding``; everything else loads as floats. The values used are exactly
the fp32 ones a float32 load would hold, so greedy output still matches Hugging Face's float32 run.
"""

from __future__ import annotations

import torch
from torch import nn

from localpaged.kernels import cpu
from localpaged.models.gguf_weights import BLOCK_FIELDS, BlockQuantized
from localpaged.models.llama import FUSED


class BlockLinear(nn.Module):
    """A projection on the native kernel, its weight packed into 16-row tiles (kernels/cpu.py)."""

    def __init__(self, weight: BlockQuantized, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.packed = cpu.pack_blocks(weight.q, weight.scale, weight.minimum)
        for name in BLOCK_FIELDS:  # registered too, so the model's memory counts them
            self.register_buffer(name, getattr(self.packed, name))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu.qgemm(x, self.packed)
        return out + self.bias if self.bias is not None else out


class BlockEmbedding(nn.Module):
    """Token embeddings kept as blocks: a step dequantises only the rows of its tokens."""

    def __init__(self, weight: BlockQuantized) -> None:
        super().__init__()
        for name in BLOCK_FIELDS:
            self.register_buffer(name, getattr(weight, name))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return BlockQuantized(self.q[ids], self.scale[ids], self.minimum[ids]).dequantize()


def swap_in_blocks(model: nn.Module, tensors: dict) -> dict[str, torch.Tensor]:
    """Put block modules in ``model`` where every shard of a weight is blocks; return the float tensors to load.

    Shards are taken out of ``tensors`` as they are packed, so the unpacked copy of each weight is freed
    once it is packed (the tied embedding's once the head has it too) rather than when loading ends.
    """
    tied = model.config.tie_word_embeddings or "lm_head.weight" not in tensors
    consumed: set[str] = set()
    for name, module in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if leaf == "embed_tokens":
            hf = ["model.embed_tokens.weight"]
        elif leaf == "lm_head":
            hf = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        elif isinstance(module, nn.Linear):
            hf = [f"model.{parent}.{shard}.weight" for shard in FUSED.get(leaf, (leaf,))]
        else:
            continue
        shards = [tensors.get(n) for n in hf]
        if not all(isinstance(s, BlockQuantized) for s in shards):
            continue
        weight = BlockQuantized.cat(shards)
        new = BlockEmbedding(weight) if leaf == "embed_tokens" else BlockLinear(weight, module.bias)
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        consumed.update(hf)
        del weight, shards
        for n in hf:
            if n != "model.embed_tokens.weight" or not tied or leaf == "lm_head":
                tensors.pop(n)
    # A block shard nobody took (its projection's other shards are floats) loads as floats.
    return {n: v.dequantize() if isinstance(v, BlockQuantized) else v for n, v in tensors.items() if n not in consumed}
