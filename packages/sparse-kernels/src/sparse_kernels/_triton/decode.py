"""Triton split-K paged decode (flash-decoding): partial softmax per KV chunk, then a reduce.

Grid ``(batch, num_kv_heads, num_splits)``, fixed for a batch size. Program ``(b, h, s)`` reads the
KV list of request ``b`` (dense: one list per request; head-sparse: one per (request, KV head)) and
handles all query heads of KV group ``h`` at once, so each K/V row is loaded once per group. The list's
tokens are cut into ``num_splits`` chunks of a multiple of ``BLOCK_N`` tokens; splits that start past
the list's end return at once. The reduce recomputes how many splits were live from the same lengths.
With ``LOGITS`` (dense lists) the split kernel also writes every query head's raw logit of each token it
reads, so a method that ranks tokens by their attention reads K once for both (OmniKV's filter layers).

With a sliding window (``window_left >= 0``) the query, at the list's last token ``n - 1``, sees tokens
from ``first = max(0, n - 1 - window_left)`` on: the splits cut ``[first, n)`` instead of ``[0, n)``, so
pages wholly before the window are never read and the partial one is read from ``first``.

Token ``j`` of a list is pool slot ``indices[start + j // PAGE_SIZE] * PAGE_SIZE + j % PAGE_SIZE``:
PAGE_SIZE is the pool's block size (entries are block ids) or 1 (entries are slot ids). Softmax runs in
base 2 (scale pre-multiplied by log2 e); the stored log-sum-exps are base 2 as well.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_enter, pdl_exit


@triton.jit
def _window_start(kv_len, window_left, WINDOW: tl.constexpr):
    """First token the list's last-token query sees: ``max(0, kv_len - 1 - window_left)``, 0 without a window."""
    if WINDOW:
        return tl.maximum(kv_len - 1 - window_left, 0)
    else:
        return kv_len * 0


@triton.jit
def store_logits(
    logits_ptr, b, heads, offs_n, s, stride_lb, stride_lh, mask_g, mask_n, TOKENS_FIRST: tl.constexpr = False
):
    """``logits[b, head, token] = s * ln 2`` for a tile of base-2 scores ``s`` ``[BLOCK_G, BLOCK_N]`` (``TOKENS_FIRST``:
    ``[BLOCK_N, BLOCK_G]``, as the transposed dots give them)."""
    row = b.to(tl.int64) * stride_lb + heads.to(tl.int64) * stride_lh
    if TOKENS_FIRST:
        tl.store(
            logits_ptr + row[None, :] + offs_n[:, None], s * 0.6931471805599453, mask=mask_n[:, None] & mask_g[None, :]
        )
    else:
        tl.store(
            logits_ptr + row[:, None] + offs_n[None, :], s * 0.6931471805599453, mask=mask_g[:, None] & mask_n[None, :]
        )


@triton.jit
def store_partial(
    o_part_ptr, lse_part_ptr, acc, m_i, l_i, b, split, num_splits, heads, offs_d, mask_g, mask_d,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr = False,
):  # fmt: skip
    """A split's normalised partial output ``acc`` ``[BLOCK_G, BLOCK_D]`` (``TRANSPOSED``: ``[BLOCK_D, BLOCK_G]``, as
    the transposed dots accumulate it) and its base-2 LSE into the split's rows, for the reduce."""
    row = (b * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split  # [BLOCK_G]
    if TRANSPOSED:
        both = mask_d[:, None] & mask_g[None, :]
        tl.store(o_part_ptr + row[None, :] * BLOCK_D + offs_d[:, None], acc / l_i[None, :], mask=both)
    else:
        both = mask_g[:, None] & mask_d[None, :]
        tl.store(o_part_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None], mask=both)
    tl.store(lse_part_ptr + row, m_i + tl.log2(l_i), mask=mask_g)


def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    indptr_ptr,
    indices_ptr,
    last_len_ptr,
    o_part_ptr,
    lse_part_ptr,
    logits_ptr,
    stride_qb,
    stride_qh,
    stride_lb,
    stride_lh,
    scale_log2,
    num_splits,
    window_left,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SPARSE: tl.constexpr,
    WINDOW: tl.constexpr,
    LOGITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if HEAD_SPARSE:
        lst = b * NUM_KV_HEADS + h
    else:
        lst = b
    # The list offsets and lengths come from the host before the step: read before the wait (the
    # entries may be written on the device by a selecting method, so they are read after it).
    page_lo = tl.load(indptr_ptr + lst)
    page_hi = tl.load(indptr_ptr + lst + 1)
    kv_len = (page_hi - page_lo - 1) * PAGE_SIZE + tl.load(last_len_ptr + lst)
    first = _window_start(kv_len, window_left, WINDOW)
    chunk = tl.cdiv(tl.cdiv(kv_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    if lo < kv_len:
        pdl_enter(USE_GDC)
        hi = tl.minimum(lo + chunk, kv_len)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = h * GROUP + offs_g
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            page = tl.load(indices_ptr + page_lo + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # int64: large pools
            kv_row = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM
            # K is read transposed, [BLOCK_D, BLOCK_N], so the dot needs no transpose.
            k = tl.load(k_ptr + kv_row[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
            if LOGITS:  # the raw logits, natural units (dense lists: column = token position)
                store_logits(logits_ptr, b, heads, offs_n, s, stride_lb, stride_lh, mask_g, mask_n)
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_row[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
            m_i = m_new
        store_partial(o_part_ptr, lse_part_ptr, acc, m_i, l_i, b, split, num_splits, heads, offs_d, mask_g, mask_d,
                      NUM_KV_HEADS, GROUP, BLOCK_D)  # fmt: skip
        pdl_exit(USE_GDC)


def _decode_reduce_kernel(
    o_part_ptr,
    lse_part_ptr,
    indptr_ptr,
    last_len_ptr,
    out_ptr,
    lse_ptr,
    x_out_ptr,
    x_lse_ptr,
    stride_ob,
    stride_oh,
    stride_xb,
    stride_xh,
    stride_xs,
    num_splits,
    x_splits,
    window_left,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SPARSE: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXTRA: tl.constexpr,
    BLOCK_X: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Merge the splits' partial states into ``out`` and the base-2 ``lse``; with ``EXTRA`` also ``x_splits``
    states over other keys (``merge_with``: normalised outputs at ``x_out_ptr`` with the given strides, natural
    log-sum-exps ``[B, Hq, x_splits]`` contiguous at ``x_lse_ptr``; ``-inf``: empty) in the same softmax."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    if HEAD_SPARSE:
        lst = b * NUM_KV_HEADS + hq // GROUP
    else:
        lst = b
    page_lo = tl.load(indptr_ptr + lst)  # host metadata: read before the wait, as in the split kernel
    page_hi = tl.load(indptr_ptr + lst + 1)
    kv_len = (page_hi - page_lo - 1) * PAGE_SIZE + tl.load(last_len_ptr + lst)
    span = kv_len - _window_start(kv_len, window_left, WINDOW)
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    live = tl.cdiv(span, chunk)  # splits that wrote a partial result
    pdl_enter(USE_GDC)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < live
    mask_d = offs_d < HEAD_DIM
    row = (b * (NUM_KV_HEADS * GROUP) + hq) * num_splits + offs_s
    lse = tl.load(lse_part_ptr + row, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    if EXTRA:  # the other keys' states, in base 2 like the splits'
        offs_x = tl.arange(0, BLOCK_X)
        mask_x = offs_x < x_splits
        x_row = (b * (NUM_KV_HEADS * GROUP) + hq).to(tl.int64) * x_splits + offs_x
        x_lse = tl.load(x_lse_ptr + x_row, mask=mask_x, other=float("-inf")) * 1.4426950408889634
        m = tl.maximum(m, tl.max(x_lse, 0))
        x_w = tl.where(mask_x, tl.exp2(x_lse - m), 0.0)  # 0 for an empty state
        x_o = tl.load(
            x_out_ptr + b.to(tl.int64) * stride_xb + hq * stride_xh + offs_x[:, None] * stride_xs + offs_d[None, :],
            mask=mask_x[:, None] & mask_d[None, :],
            other=0.0,
        )
        x_sum = tl.sum(tl.where(x_w[:, None] > 0.0, x_o * x_w[:, None], 0.0), 0)
        x_den = tl.sum(x_w, 0)
    else:
        x_sum = tl.zeros([BLOCK_D], tl.float32)
        x_den = 0.0
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)
    denom = tl.sum(w, 0) + x_den
    o = tl.load(
        o_part_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0
    )
    o = (tl.sum(o * w[:, None], 0) + x_sum) / denom
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)
    tl.store(lse_ptr + b * (NUM_KV_HEADS * GROUP) + hq, m + tl.log2(denom))
    pdl_exit(USE_GDC)


def _decode_scores_kernel(
    q_ptr,
    k_ptr,
    indptr_ptr,
    indices_ptr,
    last_len_ptr,
    lse_ptr,
    scores_ptr,
    stride_qb,
    stride_qh,
    stride_score_head,
    scale_log2,
    num_splits,
    window_left,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SPARSE: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_PAGE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Second pass for score-based methods: p = exp2(s - lse) per query head, summed over the group.
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if HEAD_SPARSE:
        lst = b * NUM_KV_HEADS + h
    else:
        lst = b
    page_lo = tl.load(indptr_ptr + lst)
    page_hi = tl.load(indptr_ptr + lst + 1)
    kv_len = (page_hi - page_lo - 1) * PAGE_SIZE + tl.load(last_len_ptr + lst)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    col0 = h * stride_score_head + page_lo.to(tl.int64) * PAGE_SIZE  # this list's first column
    if split == 0:  # unused tail of the last page reads as probability 0
        tail = kv_len + tl.arange(0, BLOCK_PAGE)
        tl.store(
            scores_ptr + col0 + tail, tl.zeros([BLOCK_PAGE], tl.float32), mask=tail < (page_hi - page_lo) * PAGE_SIZE
        )
    if lo < kv_len:
        hi = tl.minimum(lo + chunk, kv_len)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = h * GROUP + offs_g
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        lse = tl.load(lse_ptr + b * (NUM_KV_HEADS * GROUP) + heads, mask=mask_g, other=0.0)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            page = tl.load(indices_ptr + page_lo + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            kv_row = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM
            k = tl.load(k_ptr + kv_row[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2
            # Tokens before the window get probability 0 (the pass covers the whole list to write them).
            seen = mask_g[:, None] & (offs_n >= _window_start(kv_len, window_left, WINDOW))[None, :]
            p = tl.where(seen, tl.exp2(s - lse[:, None]), 0.0)
            tl.store(scores_ptr + col0 + offs_n, tl.sum(p, 0), mask=mask_n)


decode_split_kernel = Kernel(_decode_split_kernel)
decode_reduce_kernel = Kernel(_decode_reduce_kernel)
decode_scores_kernel = Kernel(_decode_scores_kernel)
