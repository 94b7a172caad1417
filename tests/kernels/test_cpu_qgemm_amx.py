"""A prompt's projections on AMX tiles (``cpu.qgemm(..., prompt=True)``, lp_qgemm_amx): as close to the float64
product as int16 activations are, every row the same bits whatever the other rows of the call, and lp_qgemm_int16
where AMX does not run."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import cpu
from tests.kernels.test_cpu_kernels import Q4_0, Q4_1, Q8_0, SHAPES, pack, random_blocks

# One library suffices: lp_qgemm_amx is plain C chosen at run time, the same in every path's build.
pytestmark = pytest.mark.skipif(
    not cpu.vnni_is_fast(), reason="no native kernels or no AVX-512 VNNI: int16 is not packed"
)
NEEDS_AMX = pytest.mark.skipif(not cpu.amx(), reason="no AMX tiles here: prompt rows run lp_qgemm_int16")
# Weights whose scale units span 256 columns (K-quants: 8 or 16 groups) and legacy ones (a unit per group), with
# tails of tiles and a pair of tiles left half empty.
AMX_SHAPES = [*SHAPES, (48, 512, Q4_1, 32), (80, 768, Q4_0, 32), (16, 256, Q8_0, 16), (272, 1024, Q4_1, 32)]


def products_bound(x: torch.Tensor, weight) -> torch.Tensor:
    """Each output's allowed distance from the float64 product: 2^-13 of sum_k |x_k w_k|. The terms' roundings
    (X to two bfloat16 terms, the dropped x.lo * w.lo) stay under 1.5 * 2^-15 of each product and the float32 sums
    well inside the rest; a wrong weight or scale moves an output by a whole product."""
    return x.double().abs() @ weight.dequantize().double().abs().T * 2.0**-13


@NEEDS_AMX
@pytest.mark.parametrize("m", [1, 5, 16, 33, 70])
@pytest.mark.parametrize("n,k,q_range,group", AMX_SHAPES)
def test_prompt_rows_on_amx_stay_within_their_roundings_of_the_exact_product(m, n, k, q_range, group):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = random_blocks(n, k, q_range, gen, group)
    x = torch.randn(m, k, generator=gen)
    packed = pack(weight, "int16")
    out = cpu.qgemm(x, packed, prompt=True)
    ref = x.double() @ weight.dequantize().double().T
    assert out.shape == (m, n)
    assert ((out.double() - ref).abs() <= products_bound(x, weight)).all()
    # and no worse than int16 activations over the whole output
    int16 = cpu.qgemm(x, packed)
    assert (out.double() - ref).norm() <= (int16.double() - ref).norm()


@NEEDS_AMX
def test_each_prompt_row_is_the_same_bits_alone_in_a_batch_and_in_any_order():
    gen = torch.Generator().manual_seed(7)
    weight = random_blocks(272, 1024, Q4_1, gen, 32)
    packed = pack(weight, "int16")
    x = torch.randn(70, 1024, generator=gen) * torch.logspace(-3, 2, 70).unsqueeze(1)
    together = cpu.qgemm(x, packed, prompt=True)
    order = torch.randperm(70, generator=gen)
    assert torch.equal(cpu.qgemm(x[order], packed, prompt=True), together[order])
    for rows in ([0], [69], [3, 40, 41], list(range(17, 50))):
        assert torch.equal(cpu.qgemm(x[rows], packed, prompt=True), together[rows])


@pytest.mark.parametrize("n,k,q_range,group", [(40, 256, Q8_0, 32), (48, 512, Q4_1, 32)])
def test_prompt_rows_are_int16_where_amx_does_not_run(n, k, q_range, group, amx_off):
    """With AMX switched off (as on every CPU without it), the kernel is lp_qgemm_int16: the same bits."""
    gen = torch.Generator().manual_seed(n + k)
    packed = pack(random_blocks(n, k, q_range, gen, group), "int16")
    x = torch.randn(9, k, generator=gen)
    assert torch.equal(cpu.qgemm(x, packed, prompt=True), cpu.qgemm(x, packed))


def test_a_scale_unit_narrower_than_a_tile_runs_int16():
    """A unit per group of 16 (16 columns: a legacy-like weight of 96 columns) cannot fill AMX's 32: lp_qgemm_int16."""
    gen = torch.Generator().manual_seed(3)
    packed = pack(random_blocks(24, 96, Q4_0, gen, 16), "int16")
    x = torch.randn(40, 96, generator=gen)
    assert packed.unit_groups == 1 and packed.group == 16
    assert torch.equal(cpu.qgemm(x, packed, prompt=True), cpu.qgemm(x, packed))
