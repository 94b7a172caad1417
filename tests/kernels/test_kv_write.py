"""write_kv (Triton) stores every token's K/V exactly into its slot and skips slot -1."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import torch_attention
from localpaged.kernels.kv_write import write_kv


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,src_dtype,cache_dtype,slot_dtype",
    [
        (2, 64, torch.float32, torch.float32, torch.int64),
        (3, 128, torch.bfloat16, torch.bfloat16, torch.int32),
        (1, 64, torch.bfloat16, torch.float32, torch.int32),  # cast to the cache dtype (exact: an upcast)
    ],
)
def test_write_kv_matches_reference_and_skips_minus_one(
    num_kv_heads, head_dim, src_dtype, cache_dtype, slot_dtype, device
):
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_tokens, num_blocks = 12, 5
    slots = torch.randperm(num_blocks * 16, generator=gen)[:num_tokens]
    slots[[0, 5, 11]] = -1
    slot_mapping = slots.to(device, slot_dtype)
    # K/V as the engine gets them: views into one projection output, not contiguous per token.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(device, src_dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    shape = (num_blocks, 16, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    torch_attention.write_kv(key, value, k_expected, v_expected, slot_mapping)

    write_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)
    untouched = torch.ones(num_blocks * 16, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert untouched.sum() == num_blocks * 16 - (num_tokens - 3)
