"""Paged attention: the path of a step (Triton on CUDA, torch and native kernels on the CPU) and the layer.

``select_attention`` picks one path for the engine; every ``Attention`` layer of the model shares
it, and the runner binds each layer to its slice of the KV pool. The metadata of a step travels as
an explicit ``AttentionMetadata`` argument through the model's forward, never through a
module-global. ``prepare`` runs once per step, before the layers, so whatever a path derives from
the block tables (the torch path's gather plan) is built once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from localpaged.kernels import cpu, torch_attention
from localpaged.layers.linear import PromptRows
from localpaged.layers.rotary_embedding import apply_rope


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes; -1 skips
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32: each sequence's rows in the flat batch
    context_lens: torch.Tensor  # [B] int32: KV length after this step's tokens
    max_q_len: int
    block_size: int
    plan: torch_attention.GatherPlan | None = None  # torch path only
    cascade: torch_attention.CascadePlan | None = (
        None  # groups sharing leading blocks (runner.cascade_plan); None: none
    )
    prompt_rows: PromptRows | None = None  # the rows that are prompt tokens, for the projections; None: none


class TorchAttention:
    """The CPU path: the native kernels where they run (decode for all-decode steps, chunked prefill for the rest),
    else torch over the block pool.

    The native prefill reads the prefix in place through the block tables; torch gathers each sequence's
    whole context out of the pool and widens it to float32 first, most of a new question's first token after
    a long cached system prompt. ``native_prefill`` is a plain attribute, so a
    benchmark can time both in one process.
    """

    name = "torch"

    @property
    def takes_cascade(self) -> bool:
        """Whether this path's kernels read a step's ``AttentionMetadata.cascade`` (the native ones do)."""
        return self.native_decode or self.native_prefill

    def __init__(self, native: bool = False, prefill_products: str = "float32") -> None:
        self.native_decode = native
        self.native_prefill = native
        self.prefill_products = prefill_products  # the native prefill's: "float32" (exact) or "int16"

    def _use_native_decode(self, meta: AttentionMetadata) -> bool:
        return self.native_decode and meta.max_q_len == 1

    def _use_torch(self, meta: AttentionMetadata) -> bool:
        return not (self._use_native_decode(meta) or self.native_prefill)

    def prepare(self, meta: AttentionMetadata) -> None:
        if self._use_torch(meta):
            meta.plan = torch_attention.build_plan(
                meta.block_tables, meta.cu_seqlens_q, meta.context_lens, meta.block_size
            )

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        torch_attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._use_native_decode(meta):
            return cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, meta.cascade)
        if self.native_prefill:
            tables, cu_seqlens_q, lens = meta.block_tables, meta.cu_seqlens_q, meta.context_lens
            products = self.prefill_products
            # int16 products round the softmax weights to bfloat16 against each pass's running max, so splitting a
            # member's keys into a shared and an own pass moves them enough to change greedy tokens on long shared
            # prompts: a faster path never changes a greedy token, so those prefills read the shared blocks per member,
            # unless the int16 prefill runs on AMX tiles, which keep float32's precision.
            takes = products == "float32" or cpu.amx_runs(k_cache.dtype, q.shape[-1])
            cascade = meta.cascade if takes else None
            return cpu.paged_prefill(q, k_cache, v_cache, tables, cu_seqlens_q, lens, scale, products, cascade)
        assert meta.plan is not None, "prepare() was not called for this step"
        return torch_attention.paged_attention(q, k_cache, v_cache, meta.plan, scale)


class TritonAttention:
    name = "triton"
    takes_cascade = True  # a step with groups goes through paged_prefill.cascade_prefill, decode rows and chunks alike

    def __init__(self) -> None:
        from localpaged.kernels import kv_write, paged_decode, paged_prefill

        self._write = kv_write.write_kv
        self._decode = paged_decode.paged_decode
        self._prefill = paged_prefill.paged_prefill
        self._cascade = paged_prefill.cascade_prefill

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._write(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping)  # kernels want dense rows

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        q = q.contiguous()
        if meta.cascade is not None:
            tables, cu, lens = meta.block_tables, meta.cu_seqlens_q, meta.context_lens
            return self._cascade(q, k_cache, v_cache, tables, cu, lens, scale, meta.cascade, meta.max_q_len)
        if meta.max_q_len == 1:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return self._prefill(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.context_lens,
            scale,
            max_q_len=meta.max_q_len,
        )


AttentionPath = TorchAttention | TritonAttention


def select_attention(
    name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int, activations: str = "float32"
) -> AttentionPath:
    """``name`` ("triton"/"torch") forces a path; otherwise Triton on CUDA and torch elsewhere.

    On the CPU in float32, every step goes to the native kernels where they build (they read heads
    in runs of 8 floats): decode for all-decode steps, chunked prefill for the rest. The chunked prefill
    rounds its products to 16 bits (``cpu.paged_prefill``'s "int16") where the projections' inputs are
    rounded too (``activations`` int16 or int8); with float32 activations it stays the exact float32 kernel.
    """
    if name == "triton" or (name is None and device.type == "cuda"):
        return TritonAttention()
    products = "float32" if activations == "float32" else "int16"
    return TorchAttention(native=cpu.runs(device, dtype) and head_dim % 8 == 0, prefill_products=products)


class Attention(nn.Module):
    """One layer's attention over the paged KV cache: rotates q and k, writes k and v, attends through the path.

    KV the native kernels take (float32, bfloat16, float16) on the CPU, with a head_dim and rotated
    dimensions (all of them, or a partial rotary's) multiples of 16, runs RoPE and the K/V write in one native pass
    (cpu.rope_write_kv), bit for bit what the torch route gives (16-bit stores round to nearest even):
    per layer that route splits qkv, rotates q and k with ~8 elementwise ops, checks the slots for -1
    and runs two index_copy_ calls. Any other case rotates with ``apply_rope`` and writes through
    the path.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, path: AttentionPath) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.path = path
        self.k_cache: torch.Tensor | None = None  # bound by the runner to this layer's slice of the pool
        self.v_cache: torch.Tensor | None = None

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The output ``[N, heads * head_dim]`` of ``qkv`` ``[N, (heads + 2 kv heads) * head_dim]``, unrotated."""
        n = qkv.shape[0]
        if (
            cpu.runs(qkv.device, qkv.dtype)
            and cos.shape[-1] % 8 == 0
            and self.head_dim % 16 == 0
            and self.k_cache.dtype in cpu.KV_DTYPES
        ):
            q = cpu.rope_write_kv(qkv, cos, sin, meta.slot_mapping, self.k_cache, self.v_cache, self.num_heads)
        else:
            q = self.rope_and_write_kv(qkv, cos, sin, meta)
        out = self.path.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(n, self.num_heads * self.head_dim)

    def rope_and_write_kv(self, qkv, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        """Rotate q and k, store k and v in the cache; returns q ``[N, heads, head_dim]``."""
        n = qkv.shape[0]
        qk, v = qkv.split(
            [(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        qk = apply_rope(qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)  # q and k in one go
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        self.path.write_kv(k, v.reshape(n, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache, meta)
        return q
