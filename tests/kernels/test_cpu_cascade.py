"""Shared-prefix ("cascade") attention in the native CPU kernels (a torch_attention.CascadePlan passed to cpu.paged_decode,
cpu.paged_prefill and through lp_llama_decode): on each instruction-set path this CPU runs, every KV type, float32
and int16 products, for batches holding several groups (members beside sequences in none), group sizes past one
tile of CASCADE_TOKENS, shared ranges of several chunks, decode rows beside chunks. Against the float64 reference
and against the same kernel without the plan; NaN wherever a kernel must not read (spare blocks, slots past a
context, unused table entries) or write (``nan_empty``). A plan the tables contradict is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged.errors import KernelArgumentError
from localpaged.kernels import cpu, torch_attention
from tests.kernels.test_cpu_prefill_int16 import assert_within_rounding

pytestmark = [
    pytest.mark.skipif(cpu.library() is None, reason="no C compiler or no 64-bit CPU: the torch path runs instead"),
    pytest.mark.usefixtures("kernel_path"),
]
PAGE = 16


def make_batch(groups, loners, num_kv_heads, head_dim, kv_dtype, gen):
    """Caches and tables for ``groups`` (each ``(shared_blocks, [(own_tokens, q_len), ...])``: members whose tables
    begin with the group's blocks) and ``loners`` (``(context, q_len)``, in no group), the batch shuffled. Returns
    (k_cache, v_cache, tables, context_lens, q_lens, plan, k_ref, v_ref)."""
    seqs = []  # (shared block ids or [], own tokens past them, q_len, group index or -1)
    next_block = 0
    for g, (shared_blocks, members) in enumerate(groups):
        shared = list(range(next_block, next_block + shared_blocks))
        next_block += shared_blocks
        seqs += [(shared, own, q_len, g) for own, q_len in members]
    seqs += [([], context, q_len, -1) for context, q_len in loners]
    order = torch.randperm(len(seqs), generator=gen).tolist()
    seqs = [seqs[i] for i in order]
    lens, tables = [], []
    for shared, own, _, _ in seqs:
        lens.append(len(shared) * PAGE + own)
        need = -(-lens[-1] // PAGE) - len(shared)
        tables.append(shared + list(range(next_block, next_block + need)))
        next_block += need
    num_blocks = next_block + 5
    ids = torch.randperm(num_blocks, generator=gen)  # blocks scattered over the pool; the last 5 are spare
    width = max(len(t) for t in tables) + 2
    table_t = ids[torch.full((len(seqs), width), num_blocks - 1)].to(torch.int32)
    shape = (num_blocks, PAGE, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"), dtype=torch.float64)
    v = torch.full(shape, float("nan"), dtype=torch.float64)
    for b, (table, n) in enumerate(zip(tables, lens)):
        table_t[b, : len(table)] = ids[table].to(torch.int32)
        slots = (ids[table][:, None] * PAGE + torch.arange(PAGE)).flatten()[:n]
        fresh = k.view(-1, num_kv_heads, head_dim)[slots].isnan().all(-1).all(-1)  # shared slots are written once
        k.view(-1, num_kv_heads, head_dim)[slots[fresh]] = torch.randn(
            int(fresh.sum()), num_kv_heads, head_dim, generator=gen, dtype=torch.float64
        )
        v.view(-1, num_kv_heads, head_dim)[slots[fresh]] = torch.randn(
            int(fresh.sum()), num_kv_heads, head_dim, generator=gen, dtype=torch.float64
        )
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    starts, members, shared_lens = [0], [], []
    for g, (shared_blocks, _) in enumerate(groups):
        members += [b for b, s in enumerate(seqs) if s[3] == g]
        starts.append(len(members))
        shared_lens.append(shared_blocks * PAGE)
    i32 = {"dtype": torch.int32}
    plan = torch_attention.CascadePlan(
        torch.tensor(starts, **i32), torch.tensor(members, **i32), torch.tensor(shared_lens, **i32)
    )
    q_lens = [s[2] for s in seqs]
    k_ref, v_ref = (c.double().nan_to_num(0.0) for c in (k, v))
    return k, v, table_t, torch.tensor(lens, **i32), q_lens, plan, k_ref, v_ref


def run(groups, loners, num_kv_heads, gqa, head_dim, kv_dtype, seed, activations=None):
    """(with the plan, without it, the float64 reference): decode where ``activations`` is None, else the chunked
    prefill with those products."""
    gen = torch.Generator().manual_seed(seed)
    if activations is None:  # decode: one query each
        groups = [(s, [(own, 1) for own, _ in members]) for s, members in groups]
        loners = [(context, 1) for context, _ in loners]
    k, v, tables, lens, q_lens, plan, k_ref, v_ref = make_batch(groups, loners, num_kv_heads, head_dim, kv_dtype, gen)
    q = torch.randn(sum(q_lens), num_kv_heads * gqa, head_dim, generator=gen)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    ref, magnitude = (
        torch_attention.paged_prefill(q.double(), k_ref, v, tables, cu, lens, scale) for v in (v_ref, v_ref.abs())
    )
    if activations is None:
        plain = cpu.paged_decode(q, k, v, tables, lens, scale)
        return cpu.paged_decode(q, k, v, tables, lens, scale, plan), plain, ref, magnitude
    with_plan = cpu.paged_prefill(q, k, v, tables, cu, lens, scale, activations, plan)
    return with_plan, cpu.paged_prefill(q, k, v, tables, cu, lens, scale, activations), ref, magnitude


def check(out, plain, ref, magnitude, head_dim, activations, assert_close):
    """Float32 products (and the AMX shared pass, whose split operands keep float32's precision): the reference's 1e-5
    and within 1e-5 of the kernel without the plan (only the order of the sums differs). int16 products: within what
    their roundings can move each element from the reference (each partial rounds its own weights)."""
    if activations == "int16" and cpu.int16_prefill_runs(head_dim):
        assert_within_rounding(out, ref, magnitude)
    else:
        assert_close(out, ref)
        assert_close(out, plain.double())


CASES = [  # (groups, loners, num_kv_heads, gqa, head_dim)
    ([(1, [(1, 1), (5, 1)])], [], 1, 1, 64),  # the least: one shared block
    ([(4, [(3, 3), (17, 1), (40, 16)]), (2, [(9, 2), (30, 5)])], [(50, 7), (3, 1)], 3, 3, 64),  # the default heads
    ([(40, [(3, 1)] * 5 + [(20, 12)])], [(700, 1)], 2, 2, 64),  # 640 shared keys: several chunks
    ([(3, [(2, 1)] * 70)], [(33, 2)], 1, 3, 64),  # 70 members: two tiles of tokens
    ([(5, [(8, 4), (1, 1), (16, 1)])], [(20, 3)], 2, 4, 24),  # heads of 24: not whole AVX-512 vectors
    ([(2, [(11, 9), (4, 1)]), (1, [(1, 1), (2, 2)]), (6, [(7, 1), (7, 1)])], [], 1, 8, 16),
]


@pytest.mark.parametrize("activations", [None, "float32", "int16"])
@pytest.mark.parametrize("kv_dtype", cpu.KV_DTYPES)
@pytest.mark.parametrize("groups,loners,num_kv_heads,gqa,head_dim", CASES)
def test_cascade_matches_the_reference_and_the_kernel_without_it(
    groups, loners, num_kv_heads, gqa, head_dim, kv_dtype, activations, assert_close, nan_empty
):
    out, plain, ref, magnitude = run(
        groups, loners, num_kv_heads, gqa, head_dim, kv_dtype, len(groups) + head_dim, activations
    )
    check(out, plain, ref, magnitude, head_dim, activations, assert_close)


member = st.tuples(st.integers(1, 40), st.integers(1, 20))  # (own tokens, q_len <= own tokens: below)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    groups=st.lists(st.tuples(st.integers(1, 12), st.lists(member, min_size=1, max_size=6)), min_size=1, max_size=3),
    loners=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 20)), max_size=3),
    num_kv_heads=st.integers(1, 3),
    gqa=st.integers(1, 4),
    head_dim=st.sampled_from([16, 24, 64]),
    kv_dtype=st.sampled_from(cpu.KV_DTYPES),
    activations=st.sampled_from([None, "float32", "int16"]),
    seed=st.integers(0, 2**16),
)
def test_cascade_matches_on_random_batches(
    groups, loners, num_kv_heads, gqa, head_dim, kv_dtype, activations, seed, assert_close
):
    groups = [(s, [(own, min(q, own)) for own, q in members]) for s, members in groups]  # chunks after the shared keys
    loners = [(context, min(q, context)) for context, q in loners]
    out, plain, ref, magnitude = run(groups, loners, num_kv_heads, gqa, head_dim, kv_dtype, seed, activations)
    check(out, plain, ref, magnitude, head_dim, activations, assert_close)


@pytest.mark.parametrize("activations", [None, "float32"])
@pytest.mark.parametrize("groups,loners,num_kv_heads,gqa,head_dim", CASES[1:4])
def test_the_float32_shared_pass_where_amx_is_off(
    groups, loners, num_kv_heads, gqa, head_dim, activations, assert_close, amx_off
):
    assert not cpu.amx()
    out, plain, ref, magnitude = run(groups, loners, num_kv_heads, gqa, head_dim, torch.float16, 5, activations)
    check(out, plain, ref, magnitude, head_dim, activations, assert_close)


@pytest.mark.skipif(not cpu.amx(), reason="this CPU has no AMX tiles (or Linux does not grant them)")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_the_amx_shared_pass_matches_the_reference(head_dim, kv_dtype, assert_close):
    """Every size the AMX pass takes: 70 members (two tiles of tokens, the second partly empty rows), 37 shared blocks
    (steps of 256 keys and a last of 80), heads of 32 to 128 (one to two passes of four accumulator tiles)."""
    groups = [(37, [(3, 1)] * 70), (5, [(2, 1)] * 9)]
    out, plain, ref, magnitude = run(groups, [(40, 1)], 2, 3, head_dim, kv_dtype, head_dim, None)
    check(out, plain, ref, magnitude, head_dim, None, assert_close)


def test_a_plan_the_tables_contradict_is_refused():
    """A member whose table differs inside the shared range, or whose chunk reaches into it, gets an error, not
    another sequence's keys."""
    gen = torch.Generator().manual_seed(0)
    k, v, tables, lens, _, plan, _, _ = make_batch([(2, [(5, 1), (5, 1)])], [], 1, 16, torch.float32, gen)
    q = torch.randn(2, 1, 16)
    cpu.paged_decode(q, k, v, tables, lens, 0.25, plan)
    other = tables.clone()
    other[1, 1] = other[1, 2]
    with pytest.raises(KernelArgumentError):
        cpu.paged_decode(q, k, v, other, lens, 0.25, plan)
    too_long = plan._replace(shared_lens=torch.tensor([48], dtype=torch.int32))
    with pytest.raises(KernelArgumentError):
        cpu.paged_decode(q, k, v, tables, lens, 0.25, too_long)
    cu = torch.tensor([0, 1, 7], dtype=torch.int32)  # the second member's 6 rows reach back into its shared keys
    with pytest.raises(KernelArgumentError):
        cpu.paged_prefill(torch.randn(7, 1, 16), k, v, tables, cu, lens, 0.25, "float32", plan)
