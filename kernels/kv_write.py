"""Scatter a step's new keys and values into their slots of the paged KV cache.

One program per token copies all its KV heads (``Hkv * head_dim`` elements, padded to a power of
two). Slot -1 marks a token whose K/V must not be stored (e.g. a padded row of a CUDA-graph batch),
so its program stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    head = i // HEAD_DIM
    d = i % HEAD_DIM
    mask = i < tl.where(slot >= 0, NUM_KV_HEADS * HEAD_DIM, 0)  # slot -1: store nothing
    block = slot // PAGE
    offset = slot % PAGE
    k = tl.load(key_ptr + t * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + head * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + head * stride_ch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[N, Hkv, D]`` into their slots (same contract as ``torch_attention.write_kv``).

    ``slot_mapping`` ``[N]`` int32 or int64; slot -1 is skipped. Values are cast to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
    )
