"""Varlen chunked-prefill attention: each sequence's new queries against its cached prefix and,
causally, themselves, all read from the paged KV cache.

The chunk's own K/V are already in the cache (``write_kv`` runs first), so cached prefix and chunk
need no separate code paths: query ``i`` of sequence ``b`` sits at position
``context_lens[b] - q_len + i`` and attends to every cached position up to its own. One program
per (query tile of ``BLOCK_M`` rows, sequence, query head) walks the pages up to the tile's last
position with an online softmax in fp32. The grid's first axis is sized from the longest chunk;
tiles past a sequence's own chunk exit at once.

``cascade_prefill`` is shared-prefix ("cascade") attention over the same kernel, FlashInfer's way: a
step's groups of sequences whose tables begin with the same blocks (``torch_attention.CascadePlan``) attend
each group's query rows together, as one unmasked tile sequence, to the shared keys (each page read once
per tile of ``BLOCK_M`` rows of all the members instead of once per member), every sequence attends its
own keys after them as before, and the two results are merged by their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_decode import BLOCK_N, dot, dot_precision, load_page_tile, softmax_step
from .torch_attention import CascadePlan

BLOCK_M = 32  # query rows per program


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cu_ptr,
    lens_ptr,
    first_ptr,
    out_ptr,
    lse_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    CAUSAL: tl.constexpr,
    CASCADE: tl.constexpr,
):
    """``CAUSAL`` False: every row sees all ``ctx`` keys (a cascade group's shared ones). ``CASCADE``: keys from
    ``first_ptr[b]`` on (a multiple of PAGE, at or before every row's position), and each row's log-sum-exp to
    ``lse_ptr`` [num_q, heads]."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(lens_ptr + b)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    pos = ctx - q_len + rows if CAUSAL else ctx - 1 + 0 * rows  # each row's position in its sequence
    d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    kv_head = head // GROUP

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    # Rows past q_len see positions < end like the tile's last row, so no row is ever all-masked.
    end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M) if CAUSAL else ctx
    first = tl.load(first_ptr + b) if CASCADE else 0
    for tok0 in range(first, end, BLOCK_N):
        tok = tok0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        block = tl.load(bt_row + tok // PAGE, mask=valid, other=0).to(tl.int64)
        k = load_page_tile(k_ptr, block, tok % PAGE, valid, kv_head, stride_kb, stride_ks, stride_kh, HEAD_DIM)
        v = load_page_tile(v_ptr, block, tok % PAGE, valid, kv_head, stride_vb, stride_vs, stride_vh, HEAD_DIM)
        s = dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, INTERPRETED) * scale
        s = tl.where(valid[None, :] & (tok[None, :] <= pos[:, None]), s, float("-inf"))
        m_i, l_i, acc = softmax_step(s, v.to(q.dtype), m_i, l_i, acc, DOT_PRECISION, INTERPRETED)

    out_ptrs = out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if CASCADE:
        tl.store(lse_ptr + (q_start + rows) * tl.num_programs(2) + head, m_i + tl.log(l_i), mask=row_ok)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunk attention, same contract as ``torch_attention.paged_prefill``.

    ``q`` ``[num_q, Hq, D]``; ``cu_seqlens_q`` ``[B+1]`` int32; ``context_lens`` ``[B]`` int32, each
    sequence's KV length including its chunk. ``max_q_len`` (the longest chunk) sizes the grid;
    pass it to avoid a device-to-host sync that computing it here costs. ``out`` may be passed to
    write into. Returns ``[num_q, Hq, D]`` in ``q``'s dtype.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.stride(-1) == 1
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
    if out is None:
        out = torch.empty_like(q)
    return _launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q_len, out)


def _launch(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    max_q_len,
    out,
    first=None,
    lse=None,
    causal=True,
):
    """The kernel over the batch into ``out``: from key 0 where ``first`` is None; else from each sequence's ``first``
    key, with each row's log-sum-exp into ``lse`` [num_q, heads] fp32. ``causal`` False: every row sees all of its
    sequence's ``context_lens`` keys."""
    num_q, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert out.stride(-1) == 1
    if num_q == 0:
        return out
    _prefill_kernel[(triton.cdiv(max_q_len, BLOCK_M), context_lens.shape[0], num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        first if first is not None else context_lens,  # unread where first is None
        out,
        lse if lse is not None else out,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
        INTERPRETED=q.device.type != "cuda",
        CAUSAL=causal,
        CASCADE=first is not None,
    )
    return out


def cascade_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: CascadePlan,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """``paged_prefill``'s result (decode rows, one query each, included) with ``plan``'s groups attending their
    shared keys together (see the module docstring). Each member's first ``plan.shared_lens`` keys must lie in its
    group's blocks and before its first row (runner.cascade_plan makes it so). The merge runs in fp32."""
    batch, dev = context_lens.shape[0], q.device
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
    members, group_starts = plan.members.long(), plan.group_starts.long()
    sizes = group_starts[1:] - group_starts[:-1]
    first = torch.zeros(batch, dtype=torch.int32, device=dev)
    first[members] = torch.repeat_interleave(plan.shared_lens, sizes).to(torch.int32)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
    _launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q_len, out, first, lse)
    # Each group's rows, member by member, as one sequence over the group's shared keys, unmasked.
    cu = cu_seqlens_q.long()
    member_rows = cu[members + 1] - cu[members]
    row_base = torch.repeat_interleave(cu[members] - (torch.cumsum(member_rows, 0) - member_rows), member_rows)
    rows = row_base + torch.arange(len(row_base), device=dev)
    group_rows = torch.zeros(len(sizes), dtype=torch.int64, device=dev)
    group_rows.index_add_(0, torch.repeat_interleave(torch.arange(len(sizes), device=dev), sizes), member_rows)
    group_cu = torch.cat([group_rows.new_zeros(1), torch.cumsum(group_rows, 0)]).to(torch.int32)
    tables = block_tables[members[group_starts[:-1]]].contiguous()
    q_shared = q[rows].contiguous()
    out_shared = torch.empty_like(q_shared)
    lse_shared = torch.empty(q_shared.shape[:2], dtype=torch.float32, device=dev)
    lens = plan.shared_lens.to(torch.int32)
    most = int(group_rows.max())
    zeros = torch.zeros_like(lens)
    _launch(q_shared, k_cache, v_cache, tables, group_cu, lens, scale, most, out_shared, zeros, lse_shared, False)
    own_lse = lse[rows]
    top = torch.maximum(own_lse, lse_shared)
    w_own, w_shared = torch.exp(own_lse - top)[..., None], torch.exp(lse_shared - top)[..., None]
    merged = (out[rows].float() * w_own + out_shared.float() * w_shared) / (w_own + w_shared)
    out[rows] = merged.to(out.dtype)
    return out
