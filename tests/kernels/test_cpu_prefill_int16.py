"""The chunked prefill with int16 products (cpu.paged_prefill's activations="int16", kernels/cpu_prefill_int16.c):
int16 q and K for the scores, bfloat16 weights and V for the weighted sum, where the CPU has AVX-512 VNNI and BF16.
The same cases as the float32 kernel's (test_cpu_paged_prefill.py: NaN wherever the kernel must not read or write),
within what their roundings can move each element from the float64 reference; where the int16 kernel does not run (another CPU, heads that are not
whole 16-float vectors) the call is the float32 kernel's and meets its 1e-5. One build suffices: the kernel is the
same code in every path's library, chosen at run time."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged.kernels import cpu, torch_attention
from tests.kernels.test_cpu_paged_prefill import CASES, chunks, prefill_and_reference

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler or no 64-bit CPU: nothing to call")


def assert_within_rounding(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Each element of ``out`` within what the int16 products' roundings can move it from the float64 reference.

    The weights and V are rounded to bfloat16, whose unit roundoff is 2^-8 (8 significant bits). A weight's rounding
    moves the normalised output o by its share of (v - o), so all of them by at most 2^-8 (sum w|v| + |o|); V's
    rounding by at most 2^-8 sum w|v|. ``magnitude`` is sum w|v| (the reference over |V|). The int16 rounding of q and
    K moves the scores by ~1e-4 and the weights by as little again, inside the margin this leaves: over 400 random
    batches the error used at most 55% of the bound. A key left out or read from a wrong row moves an output by its
    weight's share of v - o, which the test below holds past the bound."""
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written, or poison was read"
    bound = 2**-7 * magnitude + 2**-8 * ref.abs()
    used = ((out.double() - ref).abs() / bound).max().item()
    assert used <= 1.0, f"an element is off by {used:.2f}x what bfloat16's rounding of the weights and V can explain"


def check(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, head_dim: int, assert_close) -> None:
    """Within the roundings' bound where the int16 kernel runs, else within the float32 kernel's own tolerance."""
    if cpu.int16_prefill_runs(head_dim):
        assert_within_rounding(out, ref, magnitude)
    else:
        assert_close(out, ref)


def test_the_rounding_bound_rejects_a_block_read_wrong(make_paged_kv) -> None:
    """The bound is no blanket: against a reference that reads the first block's values as zeros (as a kernel reading
    a wrong row would), the int16 output fails it, on a long context and a short one."""
    for prefix, seed in ((240, 1), (16, 2)):
        gen = torch.Generator().manual_seed(seed)
        k_cache, v_cache, tables, k_ref, v_ref = (
            t.cpu() for t in make_paged_kv([prefix + 8], 2, 64, torch.float16, gen)
        )
        q = torch.randn(8, 4, 64, generator=gen)
        cu, lens = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([prefix + 8], dtype=torch.int32)
        out = cpu.paged_prefill(q, k_cache, v_cache, tables, cu, lens, 0.125, "int16")
        ref, magnitude = (
            torch_attention.paged_prefill(q.double(), k_ref, v, tables, cu, lens, 0.125) for v in (v_ref, v_ref.abs())
        )
        assert_within_rounding(out, ref, magnitude)
        first = tables[0, 0].item()
        v_ref[first] = 0.0
        wrong = torch_attention.paged_prefill(q.double(), k_ref, v_ref, tables, cu, lens, 0.125)
        with pytest.raises(AssertionError, match="bfloat16's rounding"):
            assert_within_rounding(out, wrong, magnitude)


@pytest.mark.parametrize("kv_dtype", cpu.KV_DTYPES)
@pytest.mark.parametrize("q_lens,prefix_lens,num_kv_heads,gqa,head_dim", CASES)
def test_int16_prefill_stays_near_the_reference(
    q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, assert_close, nan_empty
):
    seed = sum(q_lens) * 1000 + sum(prefix_lens) + head_dim + gqa
    case = (q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype)
    check(*prefill_and_reference(*case, make_paged_kv, seed, "int16"), head_dim, assert_close)


def test_int16_prefill_holds_over_a_long_context(make_paged_kv, assert_close):
    """The engine's long-prompt case: a 512-token chunk after 3,584 cached tokens, the default model's heads, several
    tiles of 64 positions and steps of 32 keys, float16 KV."""
    check(*prefill_and_reference([512], [3584], 3, 3, 64, torch.float16, make_paged_kv, 13, "int16"), 64, assert_close)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunks=chunks,
    num_kv_heads=st.integers(1, 3),
    gqa=st.integers(1, 4),
    head_dim=st.sampled_from([16, 24, 32, 64]),
    kv_dtype=st.sampled_from(cpu.KV_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_int16_prefill_stays_near_the_reference_on_random_shapes(
    chunks, num_kv_heads, gqa, head_dim, kv_dtype, seed, make_paged_kv, assert_close
):
    q_lens, prefix_lens = [n for n, _ in chunks], [p for _, p in chunks]
    case = (q_lens, prefix_lens, num_kv_heads, gqa, head_dim, kv_dtype)
    check(*prefill_and_reference(*case, make_paged_kv, seed, "int16"), head_dim, assert_close)


@pytest.mark.skipif(not cpu.amx(), reason="no AMX tiles here: the tests above ran the VNNI tile")
@pytest.mark.parametrize("q_lens,prefix_lens,num_kv_heads,gqa,head_dim", CASES)
def test_int16_prefill_on_the_vnni_tile_where_amx_is_off(
    q_lens, prefix_lens, num_kv_heads, gqa, head_dim, make_paged_kv, assert_close, amx_off
):
    case = (q_lens, prefix_lens, num_kv_heads, gqa, head_dim, torch.float16)
    check(*prefill_and_reference(*case, make_paged_kv, sum(q_lens) + head_dim, "int16"), head_dim, assert_close)


@pytest.mark.skipif(not cpu.amx(), reason="this CPU has no AMX tiles (or Linux does not grant them)")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_amx_prefill_rows_do_not_hang_on_their_chunks(kv_dtype, make_paged_kv, assert_close):
    """On AMX tiles a row's output is the same bits whether its prompt's rows came in one chunk or three (the engine's
    chunking and its cascade groups then cannot move a greedy token), and within float32's 1e-5 of the reference."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, k_ref, v_ref = (t.cpu() for t in make_paged_kv([700], 2, 64, kv_dtype, gen))
    q = torch.randn(700, 6, 64, generator=gen)
    whole = None
    for cuts in ([0, 700], [0, 300, 517, 700]):
        parts = []
        for a, b in pairwise(cuts):
            cu, lens = torch.tensor([0, b - a], dtype=torch.int32), torch.tensor([b], dtype=torch.int32)
            parts.append(cpu.paged_prefill(q[a:b].contiguous(), k_cache, v_cache, tables, cu, lens, 0.125, "int16"))
        out = torch.cat(parts)
        whole = out if whole is None else whole
        assert torch.equal(out, whole)
    cu, lens = torch.tensor([0, 700], dtype=torch.int32), torch.tensor([700], dtype=torch.int32)
    assert_close(whole, torch_attention.paged_prefill(q.double(), k_ref, v_ref, tables, cu, lens, 0.125))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int16_scores_stay_inside_int32_at_their_largest(head_dim, make_paged_kv, assert_close):
    """Every q value and every value of half the keys at its row's largest, all of one sign: those keys' integer dot
    products are the most they can be (q rounds within less for heads of over 128 values). The other keys' values
    alternate in sign (score 0), so a wrapped int32 would hand the weight to them."""
    gen = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache, tables, _, v_ref = (t.cpu() for t in make_paged_kv([48], 1, head_dim, torch.float32, gen))
    signs = torch.tensor([1.0, -1.0]).repeat(head_dim // 2)
    slots = k_cache.view(-1, head_dim)
    for slot in (~slots.isnan().any(1)).nonzero().flatten().tolist():  # the NaNs (not to be read) stay
        slots[slot] = 3.0 if slot % 2 else 3.0 * signs
    k_ref = k_cache.double().nan_to_num(0.0)
    q = torch.full((16, 2, head_dim), 2.0)
    cu, lens = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([48], dtype=torch.int32)
    out = cpu.paged_prefill(q, k_cache, v_cache, tables, cu, lens, 1.0, "int16")
    ref, magnitude = (
        torch_attention.paged_prefill(q.double(), k_ref, v, tables, cu, lens, 1.0) for v in (v_ref, v_ref.abs())
    )
    check(out, ref, magnitude, head_dim, assert_close)


def test_int16_prefill_skips_a_sequence_without_rows(make_paged_kv, assert_close):
    """A sequence of no rows in the batch (its context cached, nothing to compute) is neither rounded nor read, and
    the others' rows are as they would be alone."""
    case = ([9, 0, 40], [20, 35, 70], 3, 3, 64, torch.float16)
    check(*prefill_and_reference(*case, make_paged_kv, 5, "int16"), 64, assert_close)
