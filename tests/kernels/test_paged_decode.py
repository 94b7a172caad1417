"""paged_decode (Triton) against the float64 torch reference, over a hand-picked grid of cases.

Not a Cartesian product: the interpreter is slow, so each case varies several axes at once and
the long (>1000 token) contexts use a single KV head.
"""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import torch_attention
from localpaged.kernels.paged_decode import paged_decode

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (context_lens, num_kv_heads, gqa ratio, head_dim, dtype, num_splits)
CASES = [
    ([1], 2, 1, 64, F32, 1),
    ([15, 16, 17, 100], 2, 3, 128, F32, 1),
    ([15, 16, 17, 100], 1, 4, 64, F32, 4),  # splits past the short sequences' lengths
    ([1, 15, 16, 17, 100, 3, 33, 64, 65], 2, 1, 64, BF16, 3),
    ([1100, 17], 1, 4, 128, F32, 1),
    ([1100, 1], 1, 3, 64, F32, 7),
    ([1037, 100, 5], 1, 8, 64, BF16, 16),
    ([100, 16, 31], 2, 4, 128, F16, None),  # the default heuristic
    ([64, 200], 3, 2, 64, BF16, 2),
]


@pytest.mark.parametrize("context_lens,num_kv_heads,gqa,head_dim,dtype,num_splits", CASES)
def test_paged_decode_matches_reference(
    context_lens, num_kv_heads, gqa, head_dim, dtype, num_splits, device, make_paged_kv, assert_close, nan_empty
):
    gen = torch.Generator().manual_seed(len(context_lens) * 1000 + sum(context_lens) + head_dim + gqa)
    k_cache, v_cache, block_tables, k_ref, v_ref = make_paged_kv(context_lens, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(len(context_lens), num_kv_heads * gqa, head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    out = torch.full_like(q, float("nan"))
    paged_decode(q, k_cache, v_cache, block_tables, lens, scale, num_splits=num_splits, out=out)
    ref = torch_attention.paged_decode(q.double(), k_ref, v_ref, block_tables, lens, scale)
    assert_close(out, ref)
    assert paged_decode(q, k_cache, v_cache, block_tables, lens, scale, num_splits=num_splits).dtype == dtype
