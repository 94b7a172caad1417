"""A batch's int16 product on AMX-INT8 tiles (lp_qgemm_int16_amx, chosen by lp_qgemm_int16 from 16 rows): the same
bits as the VNNI kernel for every weight format, group, offset and min, so a row's result does not depend on how many
rows shared the call."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import cpu
from tests.kernels.test_cpu_kernels import Q4_1, Q8_0, SHAPES, pack, random_blocks

pytestmark = pytest.mark.skipif(
    not cpu.vnni_is_fast() or not cpu.amx(), reason="no AMX tiles or no AVX-512 VNNI here: one kernel runs"
)
# Tails of tiles, a K-quant's 256-column units, an odd number of groups (the last one alone).
INT16_AMX_SHAPES = [*SHAPES, (272, 1024, Q4_1, 32), (48, 800, Q8_0, 32), (32, 2048, Q4_1, 16)]


@pytest.mark.parametrize("m", [16, 17, 40, 64])
@pytest.mark.parametrize("n,k,q_range,group", INT16_AMX_SHAPES)
def test_a_batch_on_amx_tiles_is_the_vnni_kernels_bits(m, n, k, q_range, group):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    packed = pack(random_blocks(n, k, q_range, gen, group), "int16")
    # rows of very different sizes, so that each group's int16 values use their high bytes, negative ones too
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m).unsqueeze(1)
    tiles = cpu.qgemm(x, packed)
    with cpu.amx_off():
        vnni = cpu.qgemm(x, packed)
    assert torch.equal(tiles, vnni)


def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(11)
    packed = pack(random_blocks(96, 576, Q8_0, gen, 32), "int16")
    x = torch.randn(64, 576, generator=gen)
    together = cpu.qgemm(x, packed)
    for rows in ([5], [0, 1, 2], list(range(3, 19)), list(range(64))[::-1]):
        assert torch.equal(cpu.qgemm(x[rows], packed), together[rows])
