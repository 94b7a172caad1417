"""Llama's decode steps on the CPU in one native call: every decoder layer's pointers and sizes prepared once.

The CPU counterpart of ``cuda_graphs``: a decode step of a small model is hundreds of small kernel
calls, and through the model's modules each costs Python (module dispatch, argument checks, ctypes,
output tensors) on top of its arithmetic: a sizeable share of a small model's step
(``benchmarks/cpu_kernel_bench.py --decode-step`` times both). ``NativeDecode`` hands an
``LpLlama`` (cpu_kernels.h's ``lp_llama``, field for field: each layer's packed weights, norms and
KV cache slices) to ``lp_llama_decode`` (kernels/cpu_decode_step.c), which runs the same kernels in
the same order as ``models/llama.py``: the hidden states are bit for bit the module path's.
Embedding, the RoPE tables' lookup and the head stay in Python, one call each. It lives beside the
model it mirrors: a change to ``LlamaForCausalLM``'s decoder layer is a change here and in
cpu_decode_step.c.

It applies where the module path would call exactly these kernels: a Llama-family model in float32 on
the native kernels, every projection of every layer a GGUF's blocks in a whole number of 16-row tiles with
no bias but QKV's (Qwen2), per-head q and k norms or none (Qwen3), RoPE over a multiple of 16 of each head's
dimensions (all of them, or Phi-4-mini's partial rotary), and the native decode attention.
Anything else (``NativeDecode.build`` returns None) runs the modules as before.
"""

from __future__ import annotations

import ctypes

import torch

from localpaged.errors import KernelArgumentError
from localpaged.kernels import cpu
from localpaged.kernels.torch_attention import CascadePlan
from localpaged.layers.attention import AttentionMetadata, TorchAttention
from localpaged.layers.linear import BlockLinear
from localpaged.models.llama import LlamaForCausalLM


class LpProjection(ctypes.Structure):
    """cpu_kernels.h's lp_projection: a packed weight as lp_qgemm takes it."""

    _fields_ = [
        ("q", cpu.POINTER),
        ("scales", cpu.Scales),
        ("rows", cpu.SIZE),
        ("bits", ctypes.c_int32),
        ("offset", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("activations", ctypes.c_int32),  # LP_ACT_*: cpu.ACTIVATIONS' index
    ]

    @classmethod
    def of(cls, w: cpu.PackedBlocks) -> LpProjection:
        """``w``'s pointers and sizes (the caller keeps ``w`` alive); its rows must fill whole tiles."""
        if w.rows != w.q.shape[0] * cpu.TILE:
            raise KernelArgumentError(
                f"a packed weight of {w.rows} rows pads its last tile: need a multiple of {cpu.TILE}"
            )
        activations = cpu.ACTIVATIONS.index(w.activations)
        return cls(w.q.data_ptr(), w.scales, w.rows, w.bits, w.offset, w.group, activations)


class LpDecoderLayer(ctypes.Structure):
    """cpu_kernels.h's lp_decoder_layer."""

    _fields_ = [
        ("input_norm", cpu.POINTER),
        ("post_attention_norm", cpu.POINTER),
        ("qkv_bias", cpu.POINTER),
        ("q_norm", cpu.POINTER),
        ("k_norm", cpu.POINTER),
        ("qkv", LpProjection),
        ("o", LpProjection),
        ("gate_up", LpProjection),
        ("down", LpProjection),
        ("k_cache", cpu.POINTER),
        ("v_cache", cpu.POINTER),
    ]


class LpLlama(ctypes.Structure):
    """cpu_kernels.h's lp_llama: a model's decoder layers, prepared once for lp_llama_decode."""

    _fields_ = [
        ("num_layers", cpu.SIZE),
        ("hidden", cpu.SIZE),
        ("num_heads", cpu.SIZE),
        ("num_kv_heads", cpu.SIZE),
        ("head_dim", cpu.SIZE),
        ("rotary_dim", cpu.SIZE),
        ("intermediate", cpu.SIZE),
        ("num_blocks", cpu.SIZE),
        ("eps", cpu.FLOAT),
        ("scale", cpu.FLOAT),
        ("kv_dtype", ctypes.c_int32),
        ("layers", ctypes.POINTER(LpDecoderLayer)),
        ("final_norm", cpu.POINTER),
    ]


_lp_llama_decode = cpu.Kernel(
    "lp_llama_decode",
    [ctypes.POINTER(LpLlama), *[cpu.POINTER] * 6, cpu.SIZE, cpu.SIZE, cpu.POINTER, cpu.POINTER],
    bad_index="a slot_mapping entry is past the cache, a context length is below 1 or longer than its block table "
    "row, or a block id is outside the cache",
)


def llama_decode(
    model: LpLlama,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cascade: CascadePlan | None = None,
) -> torch.Tensor:
    """A decode step through every decoder layer of ``model`` and the final norm: ``x`` [B, hidden] float32 (the
    embedded tokens, one per sequence) -> [B, hidden]. ``cos``/``sin`` hold [B, rotary_dim / 2] values; each token's
    K and V go to its slot, and it attends through its block table row over ``context_lens`` tokens (``cascade``: as
    ``cpu.paged_decode`` takes it, in every layer)."""
    cpu.expect("x", x, torch.float32, 2)
    b, hidden = x.shape
    if hidden != model.hidden:
        raise KernelArgumentError(f"x has rows of {hidden}; the model's hidden size is {model.hidden}")
    half = b * model.rotary_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        cpu.expect(name, t, torch.float32, None)
        if t.numel() != half or (t.dim() and len(t) != b):
            raise KernelArgumentError(f"{name} has shape {tuple(t.shape)}: need [{b}, {model.rotary_dim // 2}] values")
    cpu.expect_index("slot_mapping", slot_mapping, 1, b)
    cpu.expect_index("block_tables", block_tables, 2, b)
    cpu.expect_index("context_lens", context_lens, 1, b)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(x)
    plan, keep = cpu.cascade_argument(cascade, b)
    _lp_llama_decode(
        ctypes.byref(model),
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        b,
        tables.shape[1],
        plan,
        out.data_ptr(),
    )
    del keep
    return out


class NativeDecode:
    """A model's decode step as one ``llama_decode`` call (see the module's docstring for when it applies)."""

    def __init__(self, model: LlamaForCausalLM, weights: LpLlama, layers: ctypes.Array) -> None:
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
        layers = (LpDecoderLayer * len(model.layers))()
        for entry, layer in zip(layers, model.layers):
            attn = layer.self_attn
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_attention_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv_bias = attn.qkv_proj.bias.data_ptr() if attn.qkv_proj.bias is not None else None
            if attn.q_norm is not None:
                entry.q_norm, entry.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
            entry.k_cache, entry.v_cache = attn.attn.k_cache.data_ptr(), attn.attn.v_cache.data_ptr()
        _bind_projections(layers, model)
        weights = LpLlama(
            num_layers=len(model.layers),
            hidden=config.hidden_size,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            rotary_dim=model.rotary_emb.cos.shape[-1] * 2,
            intermediate=config.intermediate_size,
            num_blocks=first.attn.k_cache.shape[0],
            eps=model.norm.eps,
            scale=first.attn.scale,
            kv_dtype=cpu.KV_DTYPES.index(first.attn.k_cache.dtype),
            layers=layers,
            final_norm=model.norm.weight.data_ptr(),
        )
        return cls(model, weights, layers)

    def rebind(self) -> None:
        """Point the step at the projections' packed weights again, after they moved (``models.huge_pages``)."""
        _bind_projections(self._layers, self.model)

    @staticmethod
    def applies(model: torch.nn.Module, attention: object) -> bool:
        """Whether every kernel the module path would call on a decode step of ``model`` is one of ``lp_llama_decode``'s."""
        if not isinstance(model, LlamaForCausalLM) or not isinstance(attention, TorchAttention):
            return False
        if not attention.native_decode or model.rotary_emb.cos.shape[-1] % 8:  # rotated dimensions: a multiple of 16
            return False
        norms = [model.norm] + [
            n
            for layer in model.layers
            for n in (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.self_attn.q_norm,
                layer.self_attn.k_norm,
            )
            if n is not None
        ]
        biases = [layer.self_attn.qkv_proj.bias for layer in model.layers if layer.self_attn.qkv_proj.bias is not None]
        if not all(cpu.runs(t.device, t.dtype) and t.is_contiguous() for t in (*(n.weight for n in norms), *biases)):
            return False
        if len({n.eps for n in norms}) != 1 or model.head_dim % 16 or model.config.hidden_size % 8:
            return False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.attn.k_cache is None or attn.attn.k_cache.dtype not in cpu.KV_DTYPES:
                return False
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not isinstance(proj, BlockLinear) or proj.packed.rows % cpu.TILE:
                    return False
                if proj.bias is not None and proj is not attn.qkv_proj:  # the step adds the QKV bias alone
                    return False
        return True

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states ``[B, hidden]`` of a decode step (one token per sequence), as ``model(...)`` gives."""
        cos, sin = self.model.rotary_emb(positions)
        x = self.model.embed_tokens(input_ids)
        tables, lens = meta.block_tables, meta.context_lens
        return llama_decode(self.weights, x, cos, sin, meta.slot_mapping, tables, lens, meta.cascade)


def _bind_projections(layers: ctypes.Array, model: torch.nn.Module) -> None:
    for entry, layer in zip(layers, model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        entry.qkv = LpProjection.of(attn.qkv_proj.packed)
        entry.o = LpProjection.of(attn.o_proj.packed)
        entry.gate_up = LpProjection.of(mlp.gate_up_proj.packed)
        entry.down = LpProjection.of(mlp.down_proj.packed)
