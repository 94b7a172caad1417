"""Plain-torch paged attention: the engine's CPU attention where the native kernels do not run (and its KV write
wherever they do), and the oracle the Triton and native kernels are tested against.

The KV cache layout is shared with the Triton kernels: per layer, one tensor for K and one for V,
each shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset``; ``block_tables[b, i]`` is the block holding sequence ``b``'s
tokens ``i*block_size .. (i+1)*block_size - 1``.

Batched rather than a loop per sequence: a step's block tables become one padded gather index and
one mask (a ``GatherPlan``), built once per step and reused by every layer, and attention is a single
``scaled_dot_product_attention`` call per group of sequences. Decoding sequences (one query each)
and prefilling ones (a chunk each) are separate groups, so a long chunk never pads every decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[N, num_kv_heads, head_dim]`` into their slots; slot -1 is skipped."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


class CascadePlan(NamedTuple):
    """Groups of a step's sequences whose block tables begin with the same blocks, as the kernels take them (the
    native CPU kernels' lp_cascade, cpu_kernels.h): group g's members are ``members[group_starts[g]:group_starts[g +
    1]]`` (batch indices), whose first ``shared_lens[g]`` keys (whole blocks, before each member's first query of the
    step) lie in the same blocks. Attention reads those keys once for the whole group. All int32."""

    group_starts: torch.Tensor  # [G + 1], from 0
    members: torch.Tensor  # [group_starts[-1]]
    shared_lens: torch.Tensor  # [G] keys


@dataclass
class GroupPlan:
    """Gather indices for one group of sequences that share a padded query length."""

    blocks: torch.Tensor  # [G, nb] block of each 16-token span from `first` on (0 where padded)
    mask: torch.Tensor  # [G, 1, max_q, max_ctx] True where the query may attend
    q_index: torch.Tensor  # [G, max_q] row of the flat query (num_q, a zero row, where padded)
    q_valid: torch.Tensor  # [G, max_q] True for real query rows
    prefix_blocks: torch.Tensor | None = None  # [P] blocks every sequence of the group shares
    bias: torch.Tensor | None = None  # the mask as 0/-inf in the queries' dtype, made by the first layer


@dataclass
class GatherPlan:
    """Everything the torch path needs to attend over the block pool for one step."""

    groups: list[GroupPlan]
    num_q: int


def build_plan(
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> GatherPlan:
    """Turn block tables into gather indices and masks (see the module docstring).

    ``cu_seqlens_q`` ``[B+1]`` delimits each sequence's query rows in the flat query;
    ``context_lens`` ``[B]`` is each sequence's KV length including its new tokens, whose K/V
    are already in the cache. Query ``i`` of sequence ``b`` sits at position
    ``context_lens[b] - q_len[b] + i`` and attends to every KV position up to its own.
    """
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    num_q = int(cu_seqlens_q[-1])
    decode = torch.nonzero(q_lens == 1).flatten()
    prefill = torch.nonzero(q_lens > 1).flatten()
    groups = []
    for idx, cascade in ((decode, True), (prefill, False)):
        if idx.numel():
            tables, lens = block_tables[idx], context_lens[idx].long()
            shared = _shared_blocks(tables, lens, block_size) if cascade else 0
            groups.append(_group_plan(tables, cu_seqlens_q[idx].long(), q_lens[idx], lens, block_size, num_q, shared))
    return GatherPlan(groups=groups, num_q=num_q)


def _shared_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> int:
    """Leading blocks that every decoding sequence of the group holds (a shared system prompt, say).

    Attention reads them once for all queries instead of once per sequence ("cascade" attention).
    Only blocks wholly before every sequence's newest token count; one sequence alone shares nothing.
    """
    if block_tables.shape[0] < 2:
        return 0
    limit = (int(context_lens.min()) - 1) // block_size
    same = (block_tables[:, :limit] == block_tables[:1, :limit]).all(dim=0)
    return int(same.long().cumprod(dim=0).sum())


def _group_plan(
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    num_q: int,
    shared_blocks: int = 0,
) -> GroupPlan:
    device = block_tables.device
    max_ctx = int(context_lens.max())
    max_q = int(q_lens.max())
    # Whole blocks are gathered (one 16-token copy each, not 16 single-token ones); positions
    # before `first` are the shared prefix, read separately.
    first = shared_blocks * block_size
    block_idx = torch.arange(shared_blocks, -(-max_ctx // block_size), device=device)
    blocks = block_tables[:, block_idx].long()
    blocks = torch.where(block_idx[None, :] * block_size < context_lens[:, None], blocks, 0)
    kv_pos = torch.arange(first, int(block_idx[-1] + 1) * block_size, device=device)
    kv_valid = kv_pos[None, :] < context_lens[:, None]

    q_off = torch.arange(max_q, device=device)
    q_valid = q_off[None, :] < q_lens[:, None]
    q_index = torch.where(q_valid, q_starts[:, None] + q_off, num_q)
    q_pos = context_lens[:, None] - q_lens[:, None] + q_off  # [G, max_q]
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
    # A padded query row attends to position 0 only, so softmax never sees an all-masked row.
    mask |= (~q_valid[:, :, None]) & (kv_pos == first)[None, None, :]
    prefix = block_tables[0, :shared_blocks].long() if shared_blocks else None
    return GroupPlan(blocks=blocks, mask=mask[:, None], q_index=q_index, q_valid=q_valid, prefix_blocks=prefix)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
) -> torch.Tensor:
    """Attention of the flat queries ``q`` ``[num_q, num_heads, head_dim]`` over the block pool.

    Padding positions read block 0 (and the unused tail of a sequence's last block) and are
    masked out, so every slot must hold finite values (a NaN would survive the mask as 0 * NaN):
    the engine allocates its cache zeroed.
    """
    q_padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
    out = torch.empty_like(q)
    for g in plan.groups:
        qg = q_padded[g.q_index].transpose(1, 2)  # [G, H, max_q, D]
        kg = k_cache[g.blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [G, Hkv, positions, D]
        vg = v_cache[g.blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
        if qg.shape[2] > 1:
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
        else:
            if g.bias is None or g.bias.dtype != q.dtype:
                g.bias = torch.zeros(g.mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~g.mask, float("-inf"))
            kp = vp = None
            if g.prefix_blocks is not None:
                kp = k_cache[g.prefix_blocks].flatten(0, 1).to(q.dtype)
                vp = v_cache[g.prefix_blocks].flatten(0, 1).to(q.dtype)
            og = _decode_attention(qg, kg, vg, g.bias, kp, vp, scale)
        out[g.q_index[g.q_valid]] = og.transpose(1, 2)[g.q_valid]
    return out


def _attention_with_lse(q, k, v, bias, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its log-sum-exp (which merging a split softmax needs).

    On the CPU this is the flash kernel behind scaled_dot_product_attention, called directly since
    it returns the log-sum-exp too; it exists for the CPU only, so elsewhere (the reference run on
    CUDA against the Triton kernels) it is computed plainly, in fp32 or wider.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(dtype)
    return (torch.softmax(scores, dim=-1) @ v.to(dtype)).to(q.dtype), torch.logsumexp(scores, dim=-1)


def _decode_attention(q, k, v, bias, k_prefix, v_prefix, scale: float) -> torch.Tensor:
    """Attention of one query per sequence: ``q`` ``[G, H, 1, D]``, own ``k``/``v`` ``[G, Hkv, S, D]``
    with ``bias`` ``[G, 1, 1, S]`` (0 or -inf).

    GQA is folded rather than expanded: the query heads of a KV head become the query-length axis,
    so K/V are never repeated. With a shared prefix (``k_prefix``/``v_prefix`` ``[P, Hkv, D]``) the
    prefix is attended once, by every query of the group in one call, and merged with each
    sequence's own part by log-sum-exp.
    """
    g, h, _, d = q.shape
    hkv = k.shape[1]
    q4 = q.reshape(g, hkv, h // hkv, d)
    out, lse = _attention_with_lse(q4, k, v, bias, scale)
    if k_prefix is not None:
        q_all = q4.transpose(0, 1).reshape(1, hkv, -1, d)
        out_pre, lse_pre = _attention_with_lse(
            q_all, k_prefix.transpose(0, 1)[None], v_prefix.transpose(0, 1)[None], None, scale
        )
        out_pre = out_pre.reshape(hkv, g, -1, d).transpose(0, 1)
        lse_pre = lse_pre.reshape(hkv, g, -1).transpose(0, 1)
        lse_all = torch.logaddexp(lse, lse_pre)
        out = out * torch.exp(lse - lse_all)[..., None] + out_pre * torch.exp(lse_pre - lse_all)[..., None]
    return out.reshape(g, h, 1, d).to(q.dtype)  # lse is fp32 for half types


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen chunk attention: each sequence's new queries against its cached prefix and, causally, itself.

    Shapes: ``q`` ``[num_q, num_heads, head_dim]``, ``block_tables`` ``[B, max_blocks]`` (entries
    past a sequence's length are ignored), ``cu_seqlens_q`` ``[B+1]``, ``context_lens`` ``[B]``
    (see ``build_plan``). Returns ``[num_q, num_heads, head_dim]`` in ``q``'s dtype.
    """
    plan = build_plan(block_tables, cu_seqlens_q, context_lens, k_cache.shape[1])
    return paged_attention(q, k_cache, v_cache, plan, scale)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention: one query ``q[b]`` ``[num_heads, head_dim]`` per sequence over its whole context."""
    cu_seqlens_q = torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32)
    return paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
