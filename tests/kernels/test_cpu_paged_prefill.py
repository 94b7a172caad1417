"""The native chunked prefill (cpu.paged_prefill) on each instruction-set path this CPU runs, against the float64
torch reference: several sequences per call, prefixes that end inside a block, chunks that start mid-block, decode
rows (one query) beside chunks, GQA ratios of 1 to 8, head_dims that are multiples of 8 but not of 16, every KV
cache type, and NaN wherever the kernel must not read (spare blocks, slots past a context, unused table entries)
or write (``nan_empty``: an output row left unwritten fails)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged.kernels import cpu, torch_attention

pytestmark = [
    pytest.mark.skipif(cpu.library() is None, reason="no C compiler or no 64-bit CPU: the torch path runs instead"),
    pytest.mark.usefixtures("kernel_path"),
]

CASES = [  # (q_lens, cached prefix lens, num_kv_heads, gqa ratio, head_dim); context = prefix + q_len
    ([1], [0], 1, 1, 64),
    ([7, 16, 40], [0, 0, 0], 2, 1, 64),  # whole prompts, one of exactly a block
    ([5, 17, 33, 1], [16, 15, 0, 99], 3, 3, 64),  # the default model's heads; chunks start at and inside a block
    ([2, 37], [1098, 0], 1, 3, 64),  # a >1000-token cached prefix
    ([40, 1, 9, 1], [100, 17, 0, 3], 2, 4, 24),  # decode rows among chunks; head_dim not a multiple of 16
    ([70], [25], 1, 2, 128),  # several query tiles, the first mid-block
    ([3, 1], [5, 0], 1, 8, 16),
]


def prefill_and_reference(
    q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, seed, activations="float32"
):
    """The kernel's output for one case, the float64 reference's, and the reference over |V| (each output element's
    sum of weight x |value|: what rounding the weights and V can move it by, test_cpu_prefill_int16.py's bound)."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    k_cache, v_cache, tables, k_ref, v_ref = (
        t.cpu() for t in make_paged_kv(context_lens, num_kv_heads, head_dim, kv_dtype, gen)
    )
    q = torch.randn(sum(q_lens), num_kv_heads * gqa, head_dim, generator=gen)
    cu_seqlens_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = cpu.paged_prefill(q, k_cache, v_cache, tables, cu_seqlens_q, lens, scale, activations)
    ref, magnitude = (
        torch_attention.paged_prefill(q.double(), k_ref, v, tables, cu_seqlens_q, lens, scale)
        for v in (v_ref, v_ref.abs())
    )
    return out, ref, magnitude


def run_case(q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, assert_close, seed):
    out, ref, _ = prefill_and_reference(q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, seed)
    assert_close(out, ref)


@pytest.mark.parametrize("kv_dtype", cpu.KV_DTYPES)
@pytest.mark.parametrize("q_lens,prefix_lens,num_kv_heads,gqa,head_dim", CASES)
def test_paged_prefill_matches_reference(
    q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, assert_close, nan_empty
):
    """As for paged decode, the reference reads the very values the cache holds, so every cache type meets
    float32's 1e-5."""
    seed = sum(q_lens) * 1000 + sum(prefix_lens) + head_dim + gqa
    run_case(q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, assert_close, seed)


chunks = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 80)), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunks=chunks,
    num_kv_heads=st.integers(1, 3),
    gqa=st.integers(1, 4),
    head_dim=st.sampled_from([8, 24, 64]),
    kv_dtype=st.sampled_from(cpu.KV_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_paged_prefill_matches_reference_on_random_shapes(
    chunks, num_kv_heads, gqa, head_dim, kv_dtype, seed, make_paged_kv, assert_close
):
    q_lens, prefix_lens = [n for n, _ in chunks], [p for _, p in chunks]
    run_case(q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, assert_close, seed)


def test_a_decode_row_equals_paged_decode():
    """A batch of one-query chunks is a decode step: both kernels give it the same result."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(8, 16, 3, 64, generator=gen), torch.randn(8, 16, 3, 64, generator=gen)
    q = torch.randn(3, 9, 64, generator=gen)
    tables = torch.randperm(8, generator=gen).to(torch.int32).view(2, 4).repeat(2, 1)[:3]
    lens = torch.tensor([1, 40, 64], dtype=torch.int32)
    cu = torch.arange(4, dtype=torch.int32)
    prefill = cpu.paged_prefill(q, k_cache, v_cache, tables, cu, lens, 0.125)
    torch.testing.assert_close(prefill, cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))
