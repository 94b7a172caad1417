"""The CPU attention path (kernels/torch_attention.py) against a per-sequence loop, shared prefixes included."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import torch_attention

BS = 16


def naive(q, k_cache, v_cache, tables, cu, lens, scale):
    """One sequence, one query, one head at a time: the definition of paged causal attention."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    for b in range(len(lens)):
        ctx, start, end = int(lens[b]), int(cu[b]), int(cu[b + 1])
        slots = [int(tables[b][p // BS]) * BS + p % BS for p in range(ctx)]
        k = k_cache.view(-1, hkv, q.shape[2])[slots]
        v = v_cache.view(-1, hkv, q.shape[2])[slots]
        for i in range(end - start):
            pos = ctx - (end - start) + i
            for h in range(hq):
                kv_h = h // (hq // hkv)
                w = torch.softmax(k[: pos + 1, kv_h] @ q[start + i, h] * scale, dim=0)
                out[start + i, h] = w @ v[: pos + 1, kv_h]
    return out


@pytest.mark.parametrize(
    "shared_blocks, lens, q_lens",
    [
        (3, [60, 49, 80, 100], [1, 1, 1, 1]),  # decode with a shared 48-token prefix: the cascade path
        (0, [5, 17, 33], [1, 1, 1]),  # decode, nothing shared
        (2, [40, 70, 33, 50], [1, 5, 1, 17]),  # decodes share, prefill chunks mixed in
    ],
)
def test_matches_naive_attention(shared_blocks, lens, q_lens):
    g = torch.Generator().manual_seed(sum(lens))
    hkv, group, d, num_blocks = 2, 3, 32, 64
    k_cache = torch.randn(num_blocks, BS, hkv, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, BS, hkv, d, generator=g, dtype=torch.float64)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    prefix, rest = perm[:shared_blocks], perm[shared_blocks:]
    tables = []
    for n in lens:
        own = -(-n // BS) - shared_blocks
        tables.append(prefix + rest[:own] + [0] * (8 - shared_blocks - own))
        rest = rest[own:]
    tables_t = torch.tensor(tables, dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hkv * group, d, generator=g, dtype=torch.float64)

    plan = torch_attention.build_plan(tables_t, cu, lens_t, BS)
    decode_group = plan.groups[0]
    assert (decode_group.prefix_blocks is not None) == (shared_blocks > 0)
    got = torch_attention.paged_attention(q, k_cache, v_cache, plan, 0.2)
    want = naive(q, k_cache, v_cache, tables, cu, lens, 0.2)
    assert torch.allclose(got, want, atol=1e-10)
