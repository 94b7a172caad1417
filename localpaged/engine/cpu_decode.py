"""Decode steps on the CPU in one native call: every decoder layer's pointers and sizes prepared once.

The CPU counterpart of ``cuda_graphs``: a decode step of a small model is hundreds of small kernel
calls, and through the model's modules each costs Python (module dispatch, argument checks, ctypes,
output tensors) on top of its arithmetic: a sizeable share of a small model's step
(``benchmarks/cpu_kernel_bench.py --decode-step`` times both). ``NativeDecode`` hands
``kernels/cpu.py``'s ``lp_llama`` (each layer's packed weights, norms and KV cache slices) to
``lp_llama_decode``, which runs the same kernels in the same order as ``models/llama.py``: the hidden
states are bit for bit the module path's. Embedding, the RoPE tables' lookup and the head stay in
Python, one call each.

It applies where the module path would call exactly these kernels: a Llama-family model in float32 on
the native kernels, every projection of every layer a GGUF's blocks without a bias and a whole number of
16-row tiles, no per-head norm (Qwen3), RoPE over the whole head, and the native decode attention.
Anything else (``NativeDecode.build`` returns None) runs the modules as before.
"""

from __future__ import annotations

import ctypes

import torch

from localpaged.kernels import cpu
from localpaged.layers.attention import AttentionMetadata, TorchAttention
from localpaged.layers.linear import BlockLinear
from localpaged.models.llama import LlamaForCausalLM


class NativeDecode:
    """A model's decode step as one ``cpu.llama_decode`` call (see the module's docstring for when it applies)."""

    def __init__(self, model: LlamaForCausalLM, weights: cpu.Llama, layers: ctypes.Array) -> None:
        self.model = model
        self.weights = weights
        self._layers = layers  # the lp_decoder_layer array ``weights`` points into, kept alive with it

    @classmethod
    def build(cls, model: torch.nn.Module, attention: object) -> NativeDecode | None:
        """The native step of ``model`` with its KV cache bound (``ModelRunner`` binds it), or None where the
        module path would call other kernels than ``lp_llama_decode`` does."""
        if not cls.applies(model, attention):
            return None
        config = model.config
        first = model.layers[0].self_attn
        layers = (cpu.DecoderLayer * len(model.layers))()
        for entry, layer in zip(layers, model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_attention_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv = cpu.Projection.of(attn.qkv_proj.packed)
            entry.o = cpu.Projection.of(attn.o_proj.packed)
            entry.gate_up = cpu.Projection.of(mlp.gate_up_proj.packed)
            entry.down = cpu.Projection.of(mlp.down_proj.packed)
            entry.k_cache, entry.v_cache = attn.attn.k_cache.data_ptr(), attn.attn.v_cache.data_ptr()
        weights = cpu.Llama(
            num_layers=len(model.layers),
            hidden=config.hidden_size,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            intermediate=config.intermediate_size,
            num_blocks=first.attn.k_cache.shape[0],
            eps=model.norm.eps,
            scale=first.attn.scale,
            kv_dtype=cpu.KV_DTYPES.index(first.attn.k_cache.dtype),
            layers=layers,
            final_norm=model.norm.weight.data_ptr(),
        )
        return cls(model, weights, layers)

    @staticmethod
    def applies(model: torch.nn.Module, attention: object) -> bool:
        """Whether every kernel the module path would call on a decode step of ``model`` is one of ``lp_llama_decode``'s."""
        if not isinstance(model, LlamaForCausalLM) or not isinstance(attention, TorchAttention):
            return False
        if not attention.native_decode or model.rotary_emb.cos.shape[-1] * 2 != model.head_dim:
            return False
        norms = [model.norm] + [
            n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        if not all(cpu.runs(n.weight.device, n.weight.dtype) and n.weight.is_contiguous() for n in norms):
            return False
        if len({n.eps for n in norms}) != 1 or model.head_dim % 16 or model.config.hidden_size % 8:
            return False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or attn.attn.k_cache is None or attn.attn.k_cache.dtype not in cpu.KV_DTYPES:
                return False
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not isinstance(proj, BlockLinear) or proj.bias is not None or proj.packed.rows % cpu.TILE:
                    return False
        return True

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states ``[B, hidden]`` of a decode step (one token per sequence), as ``model(...)`` gives."""
        cos, sin = self.model.rotary_emb(positions)
        x = self.model.embed_tokens(input_ids)
        tables, lens = meta.block_tables, meta.context_lens
        return cpu.llama_decode(self.weights, x, cos, sin, meta.slot_mapping, tables, lens, meta.cascade)
