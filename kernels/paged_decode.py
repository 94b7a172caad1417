"""Flash-decoding over the paged KV cache: one query token per sequence, split-K for long contexts.

Decode is bandwidth-bound: every step reads each sequence's whole K/V once. One program per
(sequence, KV head, split) therefore loads *all* query heads that share its KV head (a GQA group,
padded to a power of two >= 16 so ``tl.dot`` accepts it on every Triton version), so each K/V byte
is read once per step rather than once per query head. Each program walks its slice of the
sequence ``BLOCK_N`` tokens at a time (several 16-token pages, gathered through the block table)
with an online softmax in fp32, and writes a partial output plus its log-sum-exp; a second kernel
merges the splits. The number of splits is fixed per launch, never derived from the context
lengths, so the launch shape depends only on tensor shapes and the call can be captured in a
CUDA graph: a split with no tokens writes ``lse = -inf`` and the merge gives it zero weight.

The ``@triton.jit`` helpers at the top are shared with ``paged_prefill``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # tokens per inner-loop tile: four 16-token pages
MAX_SPLITS = 16


@triton.jit
def load_page_tile(
    cache_ptr, block, offset, valid, kv_head, stride_block, stride_slot, stride_head, HEAD_DIM: tl.constexpr
):
    """Gather a ``[BLOCK_N, HEAD_DIM]`` tile of one KV head; rows where ``valid`` is False read 0."""
    d = tl.arange(0, HEAD_DIM)
    rows = block * stride_block + offset * stride_slot + kv_head * stride_head
    return tl.load(cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """``tl.dot``, except that under the interpreter the operands go through fp32 first: it
    multiplies bf16 bit patterns as integers (triton-lang/triton#11584, not supported upstream)."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Fold one tile of scaled, masked scores ``s`` ``[M, N]`` and values ``v`` ``[N, D]`` into
    the running max ``m_i``, normaliser ``l_i`` and fp32 accumulator ``acc`` (online softmax).

    Every row must have seen at least one unmasked score by its first tile, so ``m_new`` is finite.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    row_ok = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for tok0 in range(start, end, BLOCK_N):
        tok = tok0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        block = tl.load(bt_row + tok // PAGE, mask=valid, other=0).to(tl.int64)
        k = load_page_tile(k_ptr, block, tok % PAGE, valid, kv_head, stride_kb, stride_ks, stride_kh, HEAD_DIM)
        v = load_page_tile(v_ptr, block, tok % PAGE, valid, kv_head, stride_vb, stride_vs, stride_vh, HEAD_DIM)
        s = dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, INTERPRETED) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = softmax_step(s, v.to(q.dtype), m_i, l_i, acc, DOT_PRECISION, INTERPRETED)

    # An empty split (only possible for split > 0) has l_i == 0: output 0 with weight exp(-inf) = 0.
    has_tokens = l_i > 0
    l_safe = tl.where(has_tokens, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if NUM_SPLITS > 1:
        lse = tl.where(has_tokens, m_i + tl.log(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Combine one (sequence, head)'s split outputs, weighting each by exp(its lse - max lse)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s < NUM_SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # split 0 always holds tokens, so the max is finite
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=(s < NUM_SPLITS)[:, None],
        other=0.0,
    )
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Splits that give about two programs per SM, from shapes alone (so CUDA graphs stay valid).

    Short batches with long block tables get more splits; a batch that already fills the GPU gets
    one (no merge pass). On the CPU (interpreter) one split is fastest.
    """
    if device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * _num_sms(device.index or 0), batch * num_kv_heads)
    max_useful = triton.cdiv(max_blocks * 16, BLOCK_N)
    return max(1, min(wanted, MAX_SPLITS, max_useful))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to tf32 on tensor cores; half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, same contract as ``torch_attention.paged_decode``.

    ``q`` ``[B, Hq, D]``; caches ``[num_blocks, 16, Hkv, D]``; ``block_tables`` ``[B, max_blocks]``
    int32 (entries past a sequence's length are never read); ``context_lens`` ``[B]`` int32 >= 1.
    ``num_splits`` defaults to ``default_num_splits``; ``out`` (``[B, Hq, D]``, q's dtype) may be
    passed to write into. Returns the output in ``q``'s dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.stride(-1) == 1
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1], q.device)
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    group = num_heads // num_kv_heads
    if num_splits == 1:
        part, lse = out.unsqueeze(2), out  # the split kernel writes the final output; no lse needed
    else:
        part = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(batch, num_heads, num_splits, device=q.device, dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part,
        lse,
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
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(q.dtype),
        INTERPRETED=q.device.type != "cuda",
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part,
            lse,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
