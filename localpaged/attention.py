"""Picks the attention path: the Triton kernels on CUDA, the batched torch path on the CPU.

The metadata of a step travels as an explicit ``AttentionMetadata`` argument through the model's
forward, never through a module-global. ``prepare`` runs once per step, before the layers, so
whatever a path derives from the block tables (the torch path's gather plan) is built once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpaged.kernels import cpu, reference


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes; -1 skips
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32: each sequence's rows in the flat batch
    context_lens: torch.Tensor  # [B] int32: KV length after this step's tokens
    max_q_len: int
    block_size: int
    plan: reference.GatherPlan | None = None  # torch path only


class TorchAttention:
    """The CPU path: torch over the block pool, and the native decode kernel for all-decode fp32 steps."""

    name = "torch"

    def __init__(self, native_decode: bool = False) -> None:
        self.native_decode = native_decode

    def _use_native(self, meta: AttentionMetadata) -> bool:
        return self.native_decode and meta.max_q_len == 1

    def prepare(self, meta: AttentionMetadata) -> None:
        if not self._use_native(meta):
            meta.plan = reference.build_plan(meta.block_tables, meta.cu_seqlens_q, meta.context_lens, meta.block_size)

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        reference.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._use_native(meta):
            return cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        assert meta.plan is not None, "prepare() was not called for this step"
        return reference.paged_attention(q, k_cache, v_cache, meta.plan, scale)


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        from localpaged.kernels import kv_write, paged_decode, paged_prefill

        self._write = kv_write.write_kv
        self._decode = paged_decode.paged_decode
        self._prefill = paged_prefill.paged_prefill

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._write(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping)  # kernels want dense rows

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        q = q.contiguous()
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


def select_attention(
    name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int
) -> TorchAttention | TritonAttention:
    """``name`` ("triton"/"torch") forces a path; otherwise Triton on CUDA and torch elsewhere.

    On the CPU in float32, all-decode steps go to the native kernel where it builds (it reads heads
    in runs of 8 floats).
    """
    if name == "triton" or (name is None and device.type == "cuda"):
        return TritonAttention()
    return TorchAttention(native_decode=cpu.runs(device, dtype) and head_dim % 8 == 0)
