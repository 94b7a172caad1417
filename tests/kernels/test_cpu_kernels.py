"""The native CPU kernels (each instruction-set path this CPU runs: kernel_path) against float64 torch, on random inputs.

qgemm over row counts that take each path (1-4 rows expand weights in registers, more go through a
panel: every tail of its 6-row register kernel), padded weight tiles and
Q4_1-like (0..15 plus a min) or Q8_0-like (signed, no min) blocks, in runs of 32 or (Q6_K) 16; paged decode over ragged
lengths, shuffled block tables, GQA ratios and NaN wherever the kernel must not read, over float32,
bfloat16 and float16 caches; the fused RoPE + KV write against torch, bit for bit, into each cache type;
every 16-bit value widened, and every kind of float32 rounded, exactly as torch converts them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localpaged.errors import KernelArgumentError
from localpaged.kernels import cpu, torch_attention
from localpaged.models.gguf_weights import BlockQuantized

pytestmark = [
    pytest.mark.skipif(cpu.library() is None, reason="no C compiler or no 64-bit CPU: the torch path runs instead"),
    pytest.mark.usefixtures("kernel_path"),
]


def random_blocks(
    rows: int, cols: int, q_range: tuple[int, int], gen: torch.Generator, group: int = 32
) -> BlockQuantized:
    """q uniform in ``q_range`` (end excluded); a min per group where q is unsigned, as in Q4_1/Q5_1/Q4_K/Q5_K.

    Scales and mins as a GGUF factors them: an fp16 unit per 256 weights (a K-quant's block) where the columns hold
    whole blocks, else per group (a legacy type's), times an int8 per group (negative ones too, as Q6_K has)."""
    q = torch.randint(*q_range, (rows, cols), generator=gen, dtype=torch.int8)
    span = 256 if cols % 256 == 0 else group
    unit = (torch.rand(rows, cols // span, generator=gen) * 1e-3).half()
    mult = torch.randint(-64, 64, (rows, cols // group), generator=gen, dtype=torch.int8)
    if q_range[0] == 0:
        min_unit = -(torch.rand(rows, cols // span, generator=gen) * 2e-3).half()
        min_mult = torch.randint(0, 64, (rows, cols // group), generator=gen, dtype=torch.int8)
    else:
        min_unit, min_mult = torch.zeros_like(unit), torch.zeros_like(mult)
    return BlockQuantized(q, unit, mult, min_unit, min_mult)


def pack(weight: BlockQuantized, activations: str = "float32") -> cpu.PackedBlocks:
    return cpu.pack_blocks(weight.q, weight.unit, weight.mult, weight.min_unit, weight.min_mult, activations)


Q4_1, Q4_0, Q5_1, Q5_0, Q6_K, Q8_0 = (0, 16), (-8, 8), (0, 32), (-16, 16), (-32, 32), (-128, 128)
U6 = (0, 64)  # 6-bit values with a min and no offset (no GGUF type: its kernel instances all the same)
BITS = {Q4_1: 4, Q4_0: 4, Q5_1: 5, Q5_0: 5, Q6_K: 6, U6: 6, Q8_0: 8}
# Weights (rows, columns, q range, group) of every format and group, tails of tiles and groups of tiles.
SHAPES = [
    (16, 32, Q4_1, 32),
    (40, 64, Q8_0, 32),
    (96, 576, Q4_1, 32),
    (24, 1536, Q8_0, 32),
    (40, 256, Q8_0, 16),
    (24, 512, Q4_1, 16),
    (40, 96, Q4_0, 32),
    (24, 576, Q5_0, 32),
    (56, 64, Q5_1, 32),
    (16, 256, Q5_1, 16),
    (40, 512, Q6_K, 16),
    (24, 96, Q6_K, 32),
    (24, 48, Q6_K, 16),  # M K not a multiple of 32: split_rows' last group in plain C
    (16, 256, U6, 32),
]


@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 16, 33])
@pytest.mark.parametrize("n,k,q_range,group", SHAPES)
def test_qgemm_matches_dequantised_matmul(m, n, k, q_range, group):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = random_blocks(n, k, q_range, gen, group)
    x = torch.randn(m, k, generator=gen)
    packed = pack(weight)
    assert packed.bits == BITS[q_range] and packed.group == group
    out = cpu.qgemm(x, packed)
    ref = x.double() @ weight.dequantize().double().T
    assert out.shape == (m, n)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def integer_reference(x: torch.Tensor, weight: BlockQuantized, group: int, largest: int) -> torch.Tensor:
    """What lp_qgemm_int16 (largest 32767) and lp_qgemm_int8 (127) compute, in torch: each run of x rounded to
    integers (scale amax / largest, to nearest even), the integer dot products exact (float64), then scaled and the
    min term added in float32."""
    m, k = x.shape
    runs = x.reshape(m, k // group, group)
    amax = runs.abs().amax(-1)
    xq = torch.round(runs * torch.where(amax > 0, largest / amax, torch.zeros_like(amax))[..., None])
    dots = torch.einsum("mgk,ngk->mng", xq.double(), weight.q.double().reshape(-1, k // group, group)).float()
    return (weight.scale * ((amax / largest)[:, None, :] * dots) + weight.minimum * runs.sum(-1)[:, None, :]).sum(-1)


# Per width: the largest integer, the packed widths by q's, and how far from the exact path (measured: int16 under
# 5e-5 of the largest output, int8 under 1%).
INTEGERS = {"int16": (32767, BITS, 2e-4), "int8": (127, {**BITS, Q5_1: 8, Q5_0: 8, Q6_K: 8, U6: 8}, 2e-2)}


@pytest.mark.parametrize("activations", INTEGERS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("n,k,q_range,group", SHAPES)
def test_integer_activations_compute_integer_dot_products_and_stay_near_the_exact_path(
    m, n, k, q_range, group, activations
):
    largest, widths, off_exact = INTEGERS[activations]
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = random_blocks(n, k, q_range, gen, group)
    x = torch.randn(m, k, generator=gen)
    if k > group:
        x[0, :group] = 0.0  # a run of zeros: scale 0, nothing divided by it
    packed = pack(weight, activations)
    assert packed.activations == activations and packed.bits == widths[q_range]
    out = cpu.qgemm(x, packed)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    want = integer_reference(x, weight, group, largest)
    assert ((out - want).abs().max() / want.abs().max()).item() < 1e-5
    exact = x.double() @ weight.dequantize().double().T
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < off_exact


@pytest.mark.parametrize("n,k,q_range,group", SHAPES)
def test_int16_one_and_two_rows_get_the_bits_of_a_larger_batch(n, k, q_range, group):
    """One or two rows take their own kernel (cpu_qgemm_int16.c's tile_rows_bytes, bytes of x against the weights),
    three to fifteen the pairs kernel: every row's integers, and so its bits, are the same either way."""
    gen = torch.Generator().manual_seed(n + k + group)
    packed = pack(random_blocks(n, k, q_range, gen, group), "int16")
    x = torch.randn(3, k, generator=gen) * torch.tensor([[1.0], [1e3], [1e-3]])
    x[1, 0] = x[1].abs().max() * 2  # a run's largest value, rounded to 32767: the top of the int16 range
    batch = cpu.qgemm(x, packed)
    for m in (1, 2):
        assert torch.equal(cpu.qgemm(x[:m], packed), batch[:m])
    assert torch.equal(cpu.qgemm(x[1:3], packed), batch[1:3])


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 151936])
def test_argmax_rows_gives_the_index_torch_max_gives(n):
    """The greedy pick: the first index of each row's largest value, or of its first NaN, as torch's
    max(dim=-1).indices; ties, infinities, signed zeros and NaNs in the vector lanes and in the last columns."""
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(12, n, generator=gen)
    rows[1] = rows[1].round()  # many ties
    rows[2] = float("-inf")
    rows[3, n // 2 :] = float("inf")
    rows[4, n - 1] = float("nan")
    rows[5, :: max(n // 3, 1)] = float("nan")
    rows[6] = 0.0
    rows[6, n // 2 :] = -0.0
    rows[7] = -0.0
    rows[8] = torch.randint(-3, 3, (n,), generator=gen).float()  # ties across lanes and blocks
    rows[9, -1] = rows[9].max() + 1  # the largest in the last column
    rows[10, 0] = float("nan")
    rows[11] = torch.where(rows[11] > 0, float("-inf"), rows[11])
    assert torch.equal(cpu.argmax_rows(rows), rows.max(dim=-1).indices)
    strided = rows[3:6, ::2]  # not contiguous: copied first
    assert torch.equal(cpu.argmax_rows(strided), strided.max(dim=-1).indices)
    assert cpu.argmax_rows(rows[:0]).shape == (0,)


def race_reference(x: torch.Tensor, scale: float, key: int) -> np.ndarray:
    """A row's race scores in float64 from the same stream as lp_race_rows (cpu_rows.h): SplitMix64 at counters
    key + c GAMMA, value 2j the low half of counter j + 1 and 2j + 1 the high; E = -log1p(-w) of the 32-bit w below
    2^-8, of the top 24 bits above; the score x scale - ln(E)."""
    n = x.numel()
    with np.errstate(over="ignore"):
        z = np.uint64(key % 2**64) + np.arange(1, (n + 1) // 2 + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    bits = np.stack([z & np.uint64(0xFFFFFFFF), z >> np.uint64(32)], axis=1).reshape(-1)[:n]
    w = bits.astype(np.float64) * 2.0**-32 + 2.0**-33
    top = np.minimum((bits >> np.uint64(8)) + np.uint64(1), np.uint64(2**24 - 1)).astype(np.float64) * 2.0**-24
    exponential = np.where(w < 2.0**-8, -np.log1p(-w), -np.log1p(-top))
    return x.double().numpy() * scale - np.log(exponential)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 100, 49152])
def test_race_rows_picks_the_winner_of_a_float64_reference_of_its_stream(n):
    """The sampler's draw: each row's largest x scale - ln(E), E from its key's stream, as float64 computes them
    (where the two best lie within float32's rounding of each other, either one); a row the same alone, batched and
    from a strided view."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(24, n, generator=gen) * 4
    scale = torch.rand(24, generator=gen) * 3 + 0.2
    keys = torch.randint(-(2**63), 2**63 - 1, (24,), generator=gen)
    got = cpu.race_rows(x, scale, keys)
    for r in range(24):
        scores = race_reference(x[r], float(scale[r]), int(keys[r]))
        best = np.sort(scores)[-2:]
        if n == 1 or best[1] - best[0] > 1e-4 * max(1.0, abs(best[1])):
            assert int(got[r]) == int(scores.argmax()), r
        else:
            assert scores[int(got[r])] >= best[0], r
        assert int(cpu.race_rows(x[r : r + 1], scale[r : r + 1], keys[r : r + 1])[0]) == int(got[r])
    wide = torch.randn(24, 2 * n, generator=gen)
    wide[:, ::2] = x
    assert torch.equal(cpu.race_rows(wide[:, ::2], scale, keys), got)


def test_race_rows_draws_each_index_as_often_as_its_probability():
    """Over 40,000 keys, index i wins as often as softmax(x scale) says (within 5 standard deviations), one of
    probability 0 (x = -inf) never; at another scale (a temperature) the other softmax's frequencies."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 1e-3, 0.249, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    n = 40_000
    keys = torch.arange(n, dtype=torch.int64) * 7919
    for logits, scale in ((probs.log(), 1.0), (torch.randn(17, generator=torch.Generator().manual_seed(1)), 1 / 0.7)):
        want = torch.softmax(logits * scale, dim=-1)
        counts = torch.bincount(cpu.race_rows(logits.expand(n, -1), torch.full((n,), scale), keys), minlength=17)
        for i, p in enumerate(want.tolist()):
            assert abs(int(counts[i]) - n * p) <= 5 * (n * p * (1 - p)) ** 0.5 + 1, (i, int(counts[i]), n * p)
        assert int(counts[want == 0].sum()) == 0


def assert_race_among(got: int, keep: torch.Tensor, scores: np.ndarray) -> None:
    """got is the reference race's winner among the indices keep (either of two within float32's rounding)."""
    kept = scores[keep.numpy()]
    best = np.sort(kept)[-2:]
    if len(best) == 1 or best[1] - best[0] > 1e-4 * max(1.0, abs(best[1])):
        assert got == int(keep[kept.argmax()])
    else:
        assert got in keep.tolist()


@pytest.mark.parametrize("n", [1, 17, 300, 49152])
def test_nucleus_rows_races_among_what_top_p_keeps_of_a_float64_sort(n):
    """Top-p's draw: the tokens a float64 sort keeps (descending, while the probability before one is at most top_p;
    where a kept sum lies within float32's rounding of top_p, either way), the winner among them by race_reference's
    scores; UNDECIDED only where the nucleus reaches past the 2,048 values nearest the largest."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(16, n, generator=gen) * torch.tensor([[12.0]] * 8 + [[2.0]] * 8)
    scale = torch.rand(16, generator=gen) + 0.5
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.3, 1.0, 0.999, 0.8, 0.6] * 2)
    keys = torch.randint(-(2**63), 2**63 - 1, (16,), generator=gen)
    no_k = torch.zeros(16, dtype=torch.int64)
    got = cpu.nucleus_rows(x, scale, top_p, no_k, keys)
    for r in range(16):
        values = x[r].double() * float(scale[r])
        probs = torch.softmax(values, dim=0)
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered
        keep = order[before <= float(top_p[r])]
        if int(got[r]) == cpu.UNDECIDED:  # more than the 2,048 nearest the largest are kept
            assert len(keep) > 2048 or (values[keep] < values.max() - 1).any(), r
            continue
        if ((before - float(top_p[r])).abs() < 1e-5).any():
            continue  # the cut within float32's rounding of top_p: either side is right
        assert_race_among(int(got[r]), keep, race_reference(x[r], float(scale[r]), int(keys[r]))), r
    assert (got[:8] >= 0).all()  # peaked rows are decided
    alone = [
        int(cpu.nucleus_rows(x[r : r + 1], scale[r : r + 1], top_p[r : r + 1], no_k[:1], keys[r : r + 1])[0])
        for r in range(16)
    ]
    assert alone == got.tolist()


@pytest.mark.parametrize("n", [5, 300, 49152])
def test_nucleus_rows_takes_the_top_k_then_top_p_of_their_share(n):
    """Top-k then top-p: the k largest (as a float64 sort orders them), of those the smallest set whose share of
    their probability reaches top_p, the reference race's winner among them; every row decided (k <= 2,048), a k as
    wide as the row no top-k."""
    gen = torch.Generator().manual_seed(n + 1)
    x = torch.randn(12, n, generator=gen) * torch.tensor([[10.0]] * 6 + [[1.5]] * 6)
    scale = torch.full((12,), 1 / 0.8)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.95, 0.3] * 2)
    top_k = torch.tensor([1, 3, 40, 200, 7, n] * 2)
    keys = torch.randint(-(2**63), 2**63 - 1, (12,), generator=gen)
    got = cpu.nucleus_rows(x, scale, top_p, top_k, keys)
    assert (got >= 0).all()
    for r in range(12):
        k = min(int(top_k[r]), n)
        values = x[r].double() * float(scale[r])
        top, ids = values.sort(descending=True)
        probs = torch.softmax(top[:k], dim=0)
        before = probs.cumsum(0) - probs
        if ((before - float(top_p[r])).abs() < 1e-5).any():
            continue
        keep = ids[:k][before <= float(top_p[r])]
        assert_race_among(int(got[r]), keep, race_reference(x[r], float(scale[r]), int(keys[r]))), r
    whole = torch.zeros(1, dtype=torch.int64)  # no top-k: a k as wide as the row is the same
    assert int(got[5]) == int(cpu.nucleus_rows(x[5:6], scale[5:6], top_p[5:6], whole, keys[5:6])[0])


def test_nucleus_rows_refuses_a_row_it_cannot_draw_from():
    """-1 for a NaN, a +inf, nothing above -inf, a scale or a top_p it cannot take; one finite value among -inf
    is drawn whatever top_p."""
    x = torch.randn(7, 40)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2] = float("-inf")
    x[6] = float("-inf")
    x[6, 39] = 1.0
    scale = torch.tensor([1.0, 1.0, 1.0, float("nan"), 1.0, 1.0, 1.0])
    top_p = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.0, 1.5, 0.1])
    top_k = torch.tensor([0, 0, 0, 0, 0, 0, 3])
    got = cpu.nucleus_rows(x, scale, top_p, top_k, torch.arange(7))
    assert got.tolist() == [-1, -1, -1, -1, -1, -1, 39]
    assert int(cpu.nucleus_rows(x[:1].nan_to_num(), scale[:1], top_p[:1], torch.tensor([-1]), torch.arange(1))[0]) == -1


def test_race_rows_refuses_a_row_it_cannot_draw_from_and_leaves_the_others():
    """-1 for a row with a NaN, a +inf, a value that overflows at its scale, nothing above -inf, or a scale of NaN, 0
    or inf; a row with one finite value among -inf takes it, wherever it lies; the other rows of the call draw as
    they would alone."""
    n = 40
    x = torch.randn(8, n)
    x[0, 5] = float("nan")
    x[1, n - 1] = float("inf")
    x[2] = float("-inf")
    x[3] = float("-inf")
    x[3, n - 1] = 2.0
    x[4] = float("-inf")
    x[4, 0] = -1e30
    x[5, 7] = 3e38  # times 2: inf
    scale = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, float("nan"), 0.0, float("inf")])
    x = torch.cat([x, torch.randn(3, n)])
    keys = torch.arange(11, dtype=torch.int64)
    got = cpu.race_rows(x, scale, keys).tolist()
    assert got[:6] == [-1, -1, -1, n - 1, 0, -1] and got[8:] == [-1, -1, -1]
    assert got[6:8] == cpu.race_rows(x[6:8], scale[6:8], keys[6:8]).tolist()
    assert cpu.race_rows(x[:0], scale[:0], keys[:0]).shape == (0,)


def test_qgemm_reads_a_strided_input():
    gen = torch.Generator().manual_seed(1)
    weight = random_blocks(32, 64, Q4_1, gen)
    x = torch.randn(64, 8, generator=gen).T  # not contiguous
    out = cpu.qgemm(x, pack(weight))
    torch.testing.assert_close(out, x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


CASES = [  # (context_lens, num_kv_heads, gqa ratio, head_dim)
    ([1], 2, 1, 64),
    ([15, 16, 17, 100], 2, 3, 128),
    ([7, 1, 300, 33, 64, 65], 3, 3, 64),
    ([1100, 17], 1, 4, 128),
    ([512, 513, 1030, 3], 3, 3, 64),  # parts of up to DECODE_SPAN keys; 513: a last part of one key
    ([700, 9], 8, 2, 128),  # 8 KV heads of 128: 64-key parts, as many as DECODE_PREFETCH holds
    ([5, 40], 2, 2, 24),  # a head_dim that is not a multiple of 32
    ([9], 1, 8, 16),
]


@pytest.mark.parametrize("kv_dtype", cpu.KV_DTYPES)
@pytest.mark.parametrize("context_lens,num_kv_heads,gqa,head_dim", CASES)
def test_paged_decode_matches_reference(
    context_lens, num_kv_heads, gqa, head_dim, kv_dtype, make_paged_kv, assert_close
):
    """The float64 reference reads the very values the cache holds (``k_ref`` is the 16-bit cache widened), and
    the kernel widens 16-bit values exactly, so every cache type meets float32's 1e-5: what is left is the
    rounding of float32 sums. Storing K/V in 16 bits changes the values themselves; the engine tests measure that."""
    gen = torch.Generator().manual_seed(sum(context_lens) + head_dim + gqa)
    k_cache, v_cache, tables, k_ref, v_ref = (
        t.cpu() for t in make_paged_kv(context_lens, num_kv_heads, head_dim, kv_dtype, gen)
    )
    q = torch.randn(len(context_lens), num_kv_heads * gqa, head_dim, generator=gen)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = cpu.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert_close(out, torch_attention.paged_decode(q.double(), k_ref, v_ref, tables, lens, head_dim**-0.5))


def test_small_row_kernels_equal_torch():
    """Norm and silu match torch closely; RoPE and the cache writes match it bit for bit."""
    from localpaged.layers.rotary_embedding import apply_rope

    gen = torch.Generator().manual_seed(3)
    x, res, w = torch.randn(7, 64, generator=gen), torch.randn(7, 64, generator=gen), torch.randn(64, generator=gen)
    normed, summed = cpu.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + res, (64,), w, 1e-5), rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(5, 96, generator=gen) * 30  # far into both tails of silu
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)

    n, heads, kv_heads, d = 5, 4, 2, 32
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.rand(n, d // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    k_cache, v_cache = torch.zeros(3, 16, kv_heads, d), torch.zeros(3, 16, kv_heads, d)
    slots = torch.tensor([0, 17, -1, 40, 5])
    q = cpu.rope_write_kv(qkv, cos, sin, slots, k_cache, v_cache, heads)
    qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
    want = apply_rope(qk.reshape(n, heads + kv_heads, d), cos[:, None], sin[:, None])
    assert torch.equal(q, want[:, :heads])
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, kv_heads, d)[slots[keep]], want[keep, heads:])
    assert torch.equal(v_cache.view(-1, kv_heads, d)[slots[keep]], v.reshape(n, kv_heads, d)[keep])
    assert k_cache.view(-1, kv_heads, d).abs().sum(dim=(1, 2)).count_nonzero() == 4  # slot -1 wrote nothing


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_rope_write_kv_rotates_the_first_r_dimensions_as_torch_does(kv_dtype):
    """Partial rotary (Phi-4-mini rotates 96 of 128): cos and sin of R / 2 values rotate the first R dimensions of
    each q and k head, the rest pass through, bit for bit ``apply_rope``'s; R must be a multiple of 16 within the head."""
    from localpaged.layers.rotary_embedding import apply_rope

    gen = torch.Generator().manual_seed(11)
    n, heads, kv_heads, d, r = 6, 4, 2, 64, 48
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.rand(n, r // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    k_cache, v_cache = torch.zeros(2, 16, kv_heads, d, dtype=kv_dtype), torch.zeros(2, 16, kv_heads, d, dtype=kv_dtype)
    slots = torch.tensor([3, 0, -1, 20, 7, 31])
    q = cpu.rope_write_kv(qkv, cos, sin, slots, k_cache, v_cache, heads)
    qk = qkv[:, : (heads + kv_heads) * d].reshape(n, heads + kv_heads, d)
    want = apply_rope(qk, cos[:, None], sin[:, None])
    assert torch.equal(q, want[:, :heads]) and torch.equal(q[..., r:], qk[:, :heads, r:])
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, kv_heads, d)[slots[keep]], want[keep, heads:].to(kv_dtype))
    for bad in (40, 80):  # not a multiple of 16; wider than the head
        with pytest.raises(KernelArgumentError, match="R rotated dimensions a multiple of 16"):
            cpu.rope_write_kv(qkv, torch.ones(n, bad // 2), torch.zeros(n, bad // 2), slots, k_cache, v_cache, heads)


@pytest.mark.parametrize("m", [1, 16])  # weights expanded in registers, and into a panel
@pytest.mark.parametrize("q_range", [Q4_1, Q5_1])
def test_qgemm_uses_exactly_the_dequantised_weights(m, q_range):
    """scale * q and + min rounded one by one (gguf-py's values), never fused: one-hot rows read weights back."""
    gen = torch.Generator().manual_seed(7)
    weight = random_blocks(32, 64, q_range, gen)
    packed = pack(weight)
    columns = torch.randint(64, (m,), generator=gen)
    out = cpu.qgemm(torch.nn.functional.one_hot(columns, 64).float(), packed)
    assert torch.equal(out, weight.dequantize().T[columns])


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_rope_write_kv_rounds_into_a_16_bit_cache_as_torch_does(kv_dtype):
    """q stays float32 and equals the float32 cache's; K and V hold exactly what ``Tensor.to`` makes of them
    (nearest, ties to even, overflow to infinity, subnormals), so the native and torch paths fill one cache."""
    from localpaged.layers.rotary_embedding import apply_rope

    gen = torch.Generator().manual_seed(5)
    n, heads, kv_heads, d = 70, 4, 2, 32  # 64 tokens or more: the kernel's rows go to OpenMP threads
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    special = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-11), 3.4e38, 7e4, 65519.0, 65520.0, 1e-6, 3e-8, -0.0, 1e-40]
    qkv[0, -len(special) :] = torch.tensor(special)  # ties and limits of both types, in token 0's V
    angles = torch.rand(n, d // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(5 * 16, generator=gen)[:n]
    slots[3] = -1
    k_cache, v_cache = torch.zeros(5, 16, kv_heads, d, dtype=kv_dtype), torch.zeros(5, 16, kv_heads, d, dtype=kv_dtype)
    q = cpu.rope_write_kv(qkv, cos, sin, slots, k_cache, v_cache, heads)
    qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
    want = apply_rope(qk.reshape(n, heads + kv_heads, d), cos[:, None], sin[:, None])
    keep = slots >= 0
    assert q.dtype == torch.float32 and torch.equal(q, want[:, :heads])
    bits = torch.int16
    got_k, got_v = k_cache.view(-1, kv_heads, d)[slots[keep]], v_cache.view(-1, kv_heads, d)[slots[keep]]
    assert torch.equal(got_k.view(bits), want[keep, heads:].to(kv_dtype).view(bits))
    assert torch.equal(got_v.view(bits), v.reshape(n, kv_heads, d)[keep].to(kv_dtype).view(bits))
    assert k_cache.view(-1, kv_heads, d).float().abs().sum(dim=(1, 2)).count_nonzero() == n - 1  # slot -1: nothing


def test_a_nan_stays_a_nan_in_a_bfloat16_cache():
    """Rounding by integer addition would carry a NaN whose payload sits in the dropped half into an infinity."""
    d = 16
    qkv = torch.zeros(1, 3 * d)
    nans = torch.tensor([0x7F800001, 0xFF80FFFF, 0x7FC00000, 0x7FFFFFFF] * 4)  # payloads low, high and full
    qkv[0, 2 * d :] = nans.to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low 32 bits
    k_cache = torch.zeros(1, 16, 1, d, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    cpu.rope_write_kv(qkv, torch.ones(1, d // 2), torch.zeros(1, d // 2), torch.tensor([0]), k_cache, v_cache, 1)
    assert v_cache[0, 0].isnan().all()


def sixteen_bit_values(kv_dtype: torch.dtype) -> torch.Tensor:
    """Every value of ``kv_dtype``'s 65,536 bit patterns (zeros, subnormals, infinities and NaNs among them)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_widens_every_16_bit_value_exactly(kv_dtype):
    """Each bit pattern as the V of a one-token context, whose softmax weight is exactly 1 (q and K zero): the output
    is the value as the kernel widened it, which must be ``Tensor.float()``'s."""
    d = 64
    values = sixteen_bit_values(kv_dtype).view(-1, 1, d)
    n = len(values)  # sequences of one token, each in its own block
    v_cache = torch.zeros(n, 16, 1, d, dtype=kv_dtype)
    v_cache[:, 0] = values
    tables, lens = torch.arange(n, dtype=torch.int32)[:, None], torch.ones(n, dtype=torch.int32)
    out = cpu.paged_decode(torch.zeros(n, 1, d), torch.zeros_like(v_cache), v_cache, tables, lens, 1.0)
    want = values.float()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_rope_write_kv_rounds_every_kind_of_float32_as_torch_does(kv_dtype):
    """V (stored as it comes) over 2^20 random float32 bit patterns, and over each 16-bit value, the midpoint to the
    next one (a tie) and the float32 values either side of both: the cache's bits are ``Tensor.to``'s, every NaN a
    NaN (its payload is not compared: torch's vector and scalar conversions keep different ones)."""
    gen = torch.Generator().manual_seed(11)
    random_bits = torch.randint(-(2**31), 2**31, (2**20,), generator=gen, dtype=torch.int64).to(torch.int32)
    exact = sixteen_bit_values(kv_dtype).float()
    exact = exact[exact.isfinite()].sort().values
    near = torch.cat([exact, (exact[:-1].double() + exact[1:].double()).div(2).float()])  # and the ties between
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    values = torch.cat([random_bits.view(torch.float32), near, near.nextafter(up), near.nextafter(down)])
    d = 64
    values = torch.cat([values, torch.zeros(-len(values) % d)]).view(-1, d)
    n = len(values)
    qkv = torch.cat([torch.zeros(n, d), values], dim=1)  # no q heads, one K head of zeros, V
    k_cache = torch.zeros(-(-n // 16), 16, 1, d, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(n)
    cpu.rope_write_kv(qkv, torch.ones(n, d // 2), torch.zeros(n, d // 2), slots, k_cache, v_cache, 0)
    got, want = v_cache.view(-1, d)[:n], values.to(kv_dtype)
    nan = values.isnan()
    assert got[nan].isnan().all()
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
