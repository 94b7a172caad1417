"""Varlen chunked-prefill attention: each sequence's new queries against its cached prefix and,
causally, themselves, all read from the paged KV cache.

The chunk's own K/V are already in the cache (``write_kv`` runs first), so cached prefix and chunk
need no separate code paths: query ``i`` of sequence ``b`` sits at position
``context_lens[b] - q_len + i`` and attends to every cached position up to its own. One program
per (query tile of ``BLOCK_M`` rows, sequence, query head) walks the pages up to the tile's last
position with an online softmax in fp32. The grid's first axis is sized from the longest chunk;
tiles past a sequence's own chunk exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_decode import BLOCK_N, dot, dot_precision, load_page_tile, softmax_step

BLOCK_M = 32  # query rows per program


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cu_ptr,
    lens_ptr,
    out_ptr,
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
):
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
    pos = ctx - q_len + rows  # each row's position in its sequence
    d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    kv_head = head // GROUP

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    # Rows past q_len see positions < end like the tile's last row, so no row is ever all-masked.
    end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
    for tok0 in range(0, end, BLOCK_N):
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
    """Chunk attention, same contract as ``reference.paged_prefill``.

    ``q`` ``[num_q, Hq, D]``; ``cu_seqlens_q`` ``[B+1]`` int32; ``context_lens`` ``[B]`` int32, each
    sequence's KV length including its chunk. ``max_q_len`` (the longest chunk) sizes the grid;
    pass it to avoid a device-to-host sync that computing it here costs. ``out`` may be passed to
    write into. Returns ``[num_q, Hq, D]`` in ``q``'s dtype.
    """
    num_q, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    batch = context_lens.shape[0]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.stride(-1) == 1
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    if num_q == 0:
        return out
    _prefill_kernel[(triton.cdiv(max_q_len, BLOCK_M), batch, num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
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
    )
    return out
