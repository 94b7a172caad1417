"""paged_prefill (Triton) against the float64 torch reference: varlen chunks, with and without a
cached prefix, mixed in one batch (a hand-picked grid; the interpreter is slow)."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import torch_attention
from localpaged.kernels.paged_prefill import paged_prefill

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (q_lens, cached prefix lens, num_kv_heads, gqa ratio, head_dim, dtype); context = prefix + q_len
CASES = [
    ([1], [0], 1, 1, 64, F32),
    ([7, 16, 40], [0, 0, 0], 2, 1, 64, F32),  # whole prompts
    ([5, 17, 33, 1], [16, 15, 0, 99], 1, 3, 128, F32),  # mixed, prefix ends inside/at a page
    ([2, 37], [1098, 0], 1, 4, 64, F32),  # a >1000-token cached prefix
    ([40, 1, 9], [100, 17, 0], 2, 4, 64, BF16),
    ([33, 2], [1, 63], 1, 4, 128, F16),
]


@pytest.mark.parametrize("q_lens,prefix_lens,num_kv_heads,gqa,head_dim,dtype", CASES)
def test_paged_prefill_matches_reference(
    q_lens, prefix_lens, num_kv_heads, gqa, head_dim, dtype, device, make_paged_kv, assert_close, nan_empty
):
    gen = torch.Generator().manual_seed(sum(q_lens) * 1000 + sum(prefix_lens) + head_dim + gqa)
    context_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    k_cache, v_cache, block_tables, k_ref, v_ref = make_paged_kv(context_lens, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(sum(q_lens), num_kv_heads * gqa, head_dim, generator=gen).to(device, dtype)
    cu_seqlens_q = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    out = torch.full_like(q, float("nan"))
    paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale, max_q_len=max(q_lens), out=out)
    ref = torch_attention.paged_prefill(q.double(), k_ref, v_ref, block_tables, cu_seqlens_q, lens, scale)
    assert_close(out, ref)
    assert paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale).dtype == dtype


# (groups, loners, num_kv_heads, gqa, head_dim, dtype): as tests/kernels/test_cpu_cascade.py's make_batch takes them
CASCADE_CASES = [
    ([(4, [(3, 3), (17, 1), (40, 16)]), (2, [(9, 2), (30, 1)])], [(50, 7), (3, 1)], 1, 3, 64, F32),
    ([(3, [(2, 1)] * 40)], [(33, 2)], 1, 2, 64, F32),  # 40 members: two tiles of BLOCK_M rows
    ([(2, [(11, 9), (4, 1)]), (1, [(1, 1), (2, 2)])], [(5, 5)], 2, 2, 64, BF16),
]


@pytest.mark.parametrize("groups,loners,num_kv_heads,gqa,head_dim,dtype", CASCADE_CASES)
def test_cascade_prefill_matches_reference(
    groups, loners, num_kv_heads, gqa, head_dim, dtype, device, assert_close, nan_empty
):
    """Shared-prefix attention through the Triton kernel: several groups (decode rows and chunks) beside sequences
    in none, each group's shared keys unmasked for all its rows, merged with each member's own by log-sum-exp."""
    from localpaged.kernels.paged_prefill import cascade_prefill
    from tests.kernels.test_cpu_cascade import make_batch

    gen = torch.Generator().manual_seed(len(groups) + head_dim)
    k, v, tables, lens, q_lens, plan, k_ref, v_ref = make_batch(groups, loners, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(sum(q_lens), num_kv_heads * gqa, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    ref = torch_attention.paged_prefill(q.double(), k_ref, v_ref, tables, cu, lens, scale)
    to = {"device": device}
    plan = torch_attention.CascadePlan(*(t.to(**to) for t in plan))
    out = cascade_prefill(q.to(**to), k.to(**to), v.to(**to), tables.to(**to), cu.to(**to), lens.to(**to), scale, plan)
    assert_close(out.cpu(), ref)
