"""Triton split-K decode over quantized paged KV (fp8, KIVI, TurboQuant): dequantization in registers.

Same grid, lists, splits and reduce as ``decode.py`` (whose reduce kernel finishes the job): program
``(b, h, s)`` handles all query heads of KV group ``h`` over split ``s`` of its list. Only codes and
scales are read. Per-token scales (fp8, TurboQuant) stay out of the tiles: a key's scale multiplies its
score column after ``q @ K``, a value's scale its probability before ``P @ V``. KIVI walks one page per
step (``BLOCK_N`` = block size): the keys' per-channel statistics are loaded once per page and folded
into the query; the values' per-(token, group) statistics dequantize the value tile. A KIVI list's
tokens at or past ``(kv_len // S) * S`` are read from its request's full-precision tail row.

TurboQuant runs in the rotated space: the host rotates the query before and the output after (its logits,
``q R . k R``, are ``q . k``). ``LOGITS`` (fp8 / TurboQuant, dense lists): raw logits out, as in ``decode.py``.

``GROUPED`` (KIVI, transposed): a page's values enter one dot per channel group as exact codes, the group's
per-token scales folded into that dot's probabilities and the minima's term kept apart (``kivi_group_values``).

``SWAP_AB``: the dots run transposed, ``S^T = K @ Q^T`` and ``O^T += V^T @ P^T``, so a step's 32 tokens are the
MMA's rows and the query group (4) its columns, which need no padding to 16 rows (Triton pads small columns
itself); ``BLOCK_G`` is then the group's power of two. The key tile comes from the value tile's loader and the
other way round.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_kernels._triton.decode import store_logits, store_partial
from sparse_kernels._triton.launch import Kernel, pdl_enter, pdl_exit
from sparse_kernels._triton.quantized_tiles import (
    fp8_pair_rows,
    fp8_value_pairs,
    group_rows,
    kivi_group_values,
    kivi_key_page,
    kivi_key_slices,
    kivi_value_pairs,
    kivi_value_tile,
    online_softmax,
    pair_rows,
    step_rows,
    token_key_tile,
    token_scores,
    token_value_tile,
    token_values,
    transposed_rows,
)


@triton.jit
def kivi_swapped(
    q_row_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_min_ptr, v_min_ptr, k_tail_ptr, v_tail_ptr, indices_ptr,
    tail_index_ptr, o_part_ptr, lse_part_ptr, b, h, split, page_lo, lo, hi, kv_len, stride_qh, scale_log2, num_splits,
    offs_g, offs_d, mask_g, mask_d, heads,
    BITS: tl.constexpr, CPW: tl.constexpr, WORDS: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, UNPACK_WORDS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    PAIRS: tl.constexpr, GROUPED: tl.constexpr,
):  # fmt: skip
    """One split of a KIVI list with transposed dots: the group's queries as columns ``[BLOCK_D, BLOCK_G]``,
    scores ``[BLOCK_N, BLOCK_G]`` (the softmax runs along axis 0), the output accumulated as ``[BLOCK_D, BLOCK_G]``
    and stored transposed into the split's partial rows. ``PAIRS`` (float16 dots, whole words): codes through
    ``half_pairs``, keys over half-words, the values in two half tiles whose rows are ``pair_rows`` and ``pair_rows +
    CPW / 2``, each into its own accumulator ``[BLOCK_D / 2, BLOCK_G]`` (``kivi_value_pairs``). ``GROUPED`` (whole
    words, a channel group of at least 16 rows a half): the values by channel group, their scales folded into the
    probabilities (``kivi_group_values``), into accumulators ``[NUM_GROUPS, rows, BLOCK_G]`` plus the minima's term
    ``[NUM_GROUPS, BLOCK_G]``; with ``PAIRS`` its codes come through PTX too, else from plain integer ops."""
    pairs: tl.constexpr = PAIRS and DOT_DTYPE == tl.float16 and UNPACK_WORDS and 2 * WORDS >= 16
    slices: tl.constexpr = pairs or (UNPACK_WORDS and WORDS >= 16)  # keys in a dot per bit position
    GROUP_SIZE: tl.constexpr = HEAD_DIM // NUM_GROUPS
    WPG: tl.constexpr = GROUP_SIZE // CPW
    grouped: tl.constexpr = GROUPED and UNPACK_WORDS and WPG * CPW == GROUP_SIZE and (CPW // 2) * WPG >= 16
    both_q = mask_d[:, None] & mask_g[None, :]
    if not slices:
        q_t = tl.load(q_row_ptr + heads[None, :] * stride_qh + offs_d[:, None], mask=both_q, other=0.0)
        q_t = q_t.to(tl.float32) * scale_log2  # [BLOCK_D, BLOCK_G]
    m_i = tl.full(offs_g.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(offs_g.shape, tl.float32)
    if grouped:
        ROWS: tl.constexpr = (CPW // 2) * WPG
        gchan = tl.reshape(group_rows(NUM_GROUPS, CPW, WPG), [NUM_GROUPS, ROWS])
        acc_lo = tl.zeros([NUM_GROUPS, ROWS, BLOCK_G], tl.float32)
        acc_hi = tl.zeros([NUM_GROUPS, ROWS, BLOCK_G], tl.float32)
        z_acc = tl.zeros([NUM_GROUPS, BLOCK_G], tl.float32)
        offs_pair = tl.arange(0, BLOCK_N // 2)
    elif pairs:
        half = pair_rows(CPW, WORDS)  # [BLOCK_D / 2]
        mask_h = half < HEAD_DIM
        acc_lo = tl.zeros([BLOCK_D // 2, BLOCK_G], tl.float32)
        acc_hi = tl.zeros([BLOCK_D // 2, BLOCK_G], tl.float32)
    else:
        acc = tl.zeros(both_q.shape, tl.float32)
        chan = transposed_rows(offs_d, CPW, WORDS, UNPACK_WORDS)  # the channel of each row of the value tiles, acc
    full = (kv_len // PAGE_SIZE) * PAGE_SIZE
    offs_t = tl.arange(0, BLOCK_N)
    for start in range(lo, tl.minimum(hi, full), BLOCK_N):
        block = tl.load(indices_ptr + page_lo + start // PAGE_SIZE).to(tl.int64)
        rows = (block * PAGE_SIZE + offs_t) * NUM_KV_HEADS + h
        if slices:
            s = kivi_key_slices(
                q_row_ptr, heads, mask_g, stride_qh, scale_log2, k_ptr, k_scale_ptr, k_min_ptr, block, h, rows,
                BITS, CPW, WORDS, NUM_KV_HEADS, HEAD_DIM, BLOCK_G, BLOCK_N, DOT_DTYPE, PRECISION, pairs,
            )  # fmt: skip
        else:
            s = kivi_key_page(
                q_t, k_ptr, k_scale_ptr, k_min_ptr, block, h, rows, offs_d, mask_d,
                BITS, CPW, WORDS, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE, PRECISION, True,
            )  # fmt: skip
        p, alpha, l_i, m_i = online_softmax(s, m_i, l_i, 0)
        if grouped:
            rows_even = (block * PAGE_SIZE + 2 * offs_pair) * NUM_KV_HEADS + h
            acc_lo, acc_hi, z_acc = kivi_group_values(
                acc_lo, acc_hi, z_acc, alpha, p, v_ptr, v_scale_ptr, v_min_ptr, rows_even, rows_even + NUM_KV_HEADS,
                rows, BITS, CPW, WORDS, NUM_GROUPS, GROUP_SIZE, BLOCK_N, DOT_DTYPE, PRECISION, pairs,
            )  # fmt: skip
        elif pairs:
            v_lo, v_hi = kivi_value_pairs(v_ptr, v_scale_ptr, v_min_ptr, rows, BITS, CPW, WORDS, NUM_GROUPS, PAGE_SIZE,
                                          BLOCK_N)  # fmt: skip
            p = p.to(DOT_DTYPE)
            acc_lo = acc_lo * alpha[None, :] + tl.dot(v_lo, p, input_precision=PRECISION)
            acc_hi = acc_hi * alpha[None, :] + tl.dot(v_hi, p, input_precision=PRECISION)
        else:
            v = kivi_value_tile(  # [BLOCK_D, BLOCK_N]
                v_ptr, v_scale_ptr, v_min_ptr, rows, offs_d, offs_t < BLOCK_N, mask_d, BITS, CPW, WORDS, NUM_GROUPS,
                PAGE_SIZE, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE == tl.float16, True,
            )  # fmt: skip
            acc = acc * alpha[None, :] + tl.dot(v.to(DOT_DTYPE), p.to(DOT_DTYPE), input_precision=PRECISION)
    if hi > full:  # this split holds the tail (hi == kv_len; full is page-aligned, so full >= lo)
        if slices:
            q_t = tl.load(q_row_ptr + heads[None, :] * stride_qh + offs_d[:, None], mask=both_q, other=0.0)
            q_t = q_t.to(tl.float32) * scale_log2  # [BLOCK_D, BLOCK_G]
        tail = tl.load(tail_index_ptr + b).to(tl.int64)
        mask_n = full + offs_t < hi
        rows = ((tail * PAGE_SIZE + offs_t) * NUM_KV_HEADS + h) * HEAD_DIM
        k = tl.load(k_tail_ptr + rows[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        s = tl.dot(k.to(DOT_DTYPE), q_t.to(DOT_DTYPE), input_precision=PRECISION)  # [BLOCK_N, BLOCK_G]
        p, alpha, l_i, m_i = online_softmax(tl.where(mask_n[:, None], s, float("-inf")), m_i, l_i, 0)
        if grouped:
            z_acc = z_acc * alpha[None, :]
            p_g = tl.broadcast_to(p.to(DOT_DTYPE)[None, :, :], [NUM_GROUPS, BLOCK_N, BLOCK_G])
            tail_v = v_tail_ptr + rows[None, None, :] + gchan[:, :, None]
            v_lo = tl.load(tail_v, mask=mask_n[None, None, :], other=0.0).to(DOT_DTYPE)
            v_hi = tl.load(tail_v + CPW // 2, mask=mask_n[None, None, :], other=0.0).to(DOT_DTYPE)
            acc_lo = acc_lo * alpha[None, None, :] + tl.dot(v_lo, p_g, input_precision=PRECISION)
            acc_hi = acc_hi * alpha[None, None, :] + tl.dot(v_hi, p_g, input_precision=PRECISION)
        elif pairs:
            both_v = mask_n[None, :] & mask_h[:, None]
            v_lo = tl.load(v_tail_ptr + rows[None, :] + half[:, None], mask=both_v, other=0.0)
            v_hi = tl.load(v_tail_ptr + rows[None, :] + (half + CPW // 2)[:, None], mask=both_v, other=0.0)
            acc_lo = acc_lo * alpha[None, :] + tl.dot(v_lo.to(DOT_DTYPE), p.to(DOT_DTYPE), input_precision=PRECISION)
            acc_hi = acc_hi * alpha[None, :] + tl.dot(v_hi.to(DOT_DTYPE), p.to(DOT_DTYPE), input_precision=PRECISION)
        else:
            v = tl.load(v_tail_ptr + rows[None, :] + chan[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            acc = acc * alpha[None, :] + tl.dot(v.to(DOT_DTYPE), p.to(DOT_DTYPE), input_precision=PRECISION)
    if grouped:
        flat = tl.reshape(gchan, [NUM_GROUPS * ROWS])
        mask_f = flat < HEAD_DIM
        out_lo = tl.reshape(acc_lo + z_acc[:, None, :], [NUM_GROUPS * ROWS, BLOCK_G])
        out_hi = tl.reshape(acc_hi + z_acc[:, None, :], [NUM_GROUPS * ROWS, BLOCK_G])
        store_partial(o_part_ptr, lse_part_ptr, out_lo, m_i, l_i, b, split, num_splits, heads, flat, mask_g, mask_f,
                      NUM_KV_HEADS, GROUP, BLOCK_D, True)  # fmt: skip
        store_partial(o_part_ptr, lse_part_ptr, out_hi, m_i, l_i, b, split, num_splits, heads, flat + CPW // 2,
                      mask_g, mask_f, NUM_KV_HEADS, GROUP, BLOCK_D, True)  # fmt: skip
    elif pairs:
        store_partial(o_part_ptr, lse_part_ptr, acc_lo, m_i, l_i, b, split, num_splits, heads, half, mask_g, mask_h,
                      NUM_KV_HEADS, GROUP, BLOCK_D, True)  # fmt: skip
        store_partial(o_part_ptr, lse_part_ptr, acc_hi, m_i, l_i, b, split, num_splits, heads, half + CPW // 2,
                      mask_g, mask_h, NUM_KV_HEADS, GROUP, BLOCK_D, True)  # fmt: skip
    else:
        store_partial(o_part_ptr, lse_part_ptr, acc, m_i, l_i, b, split, num_splits, heads, chan, mask_g, mask_d,
                      NUM_KV_HEADS, GROUP, BLOCK_D, True)  # fmt: skip


@triton.jit
def token_swapped_step(
    acc, m_i, l_i, q_t, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, codebook_ptr, indices_ptr, logits_ptr, b, page_lo,
    start, hi, h, stride_lb, stride_lh, scale_log2, offs_d, mask_g, mask_d, heads,
    SCHEME: tl.constexpr, BITS: tl.constexpr, CPW: tl.constexpr, WORDS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, LOGITS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
    FP8_PAIRS: tl.constexpr,
):  # fmt: skip
    """``token_swapped``'s step over tokens ``start + arange(BLOCK_N)``: ``(acc, m_i, l_i)`` updated. Without
    ``MASKED`` every token is the list's (a whole step), so no load, score or page id is masked."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < hi
    else:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
    rows = step_rows(indices_ptr, page_lo, start, hi, offs_n, mask_n, h, PAGE_SIZE, NUM_KV_HEADS, BLOCK_N)
    k_scale = tl.load(k_scale_ptr + rows, mask=mask_n, other=0.0) * scale_log2
    k = token_value_tile(  # [BLOCK_N, BLOCK_D]
        k_ptr, codebook_ptr, rows, offs_d, mask_n, mask_d, SCHEME, BITS, CPW, WORDS, BLOCK_D, BLOCK_N,
        UNPACK_WORDS, DOT_DTYPE,
    )  # fmt: skip
    s = tl.dot(k, q_t, input_precision=PRECISION) * k_scale[:, None]  # [BLOCK_N, BLOCK_G]
    if LOGITS:
        store_logits(logits_ptr, b, heads, offs_n, s, stride_lb, stride_lh, mask_g, mask_n, True)
    if MASKED:
        s = tl.where(mask_n[:, None], s, float("-inf"))
    p, alpha, l_i, m_i = online_softmax(s, m_i, l_i, 0)
    v_scale = tl.load(v_scale_ptr + rows, mask=mask_n, other=0.0)
    if FP8_PAIRS:  # rows in fp8_pair_rows' order
        v = fp8_value_pairs(v_ptr, rows, mask_n, WORDS, BLOCK_N)
    else:
        v = token_key_tile(  # [BLOCK_D, BLOCK_N]
            v_ptr, codebook_ptr, rows, offs_d, mask_n, mask_d, SCHEME, BITS, CPW, WORDS, BLOCK_D, BLOCK_N,
            UNPACK_WORDS, DOT_DTYPE,
        )  # fmt: skip
    pv = (p * v_scale[:, None]).to(DOT_DTYPE)
    return acc * alpha[None, :] + tl.dot(v, pv, input_precision=PRECISION), m_i, l_i


@triton.jit
def token_swapped(
    q_row_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, codebook_ptr, indices_ptr, o_part_ptr, lse_part_ptr,
    logits_ptr, b, split, page_lo, lo, hi, h, stride_qh, stride_lb, stride_lh, scale_log2, num_splits,
    offs_g, offs_d, mask_g, mask_d, heads,
    SCHEME: tl.constexpr, BITS: tl.constexpr, CPW: tl.constexpr, WORDS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, LOGITS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One split of an fp8 / TurboQuant list with transposed dots: keys ``[BLOCK_N, BLOCK_D]`` (the value tile's
    loader) times the group's queries as columns, values ``[BLOCK_D, BLOCK_N]`` (the key tile's loader) times the
    probabilities ``[BLOCK_N, BLOCK_G]``; a token's scales scale its score row and its probability row."""
    both_q = mask_d[:, None] & mask_g[None, :]
    q_t = tl.load(q_row_ptr + heads[None, :] * stride_qh + offs_d[:, None], mask=both_q, other=0.0).to(DOT_DTYPE)
    m_i = tl.full(offs_g.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(offs_g.shape, tl.float32)
    acc = tl.zeros(both_q.shape, tl.float32)
    # fp8 on the GPU: the value tile from 32-bit words of token pairs (``fp8_value_pairs``), its rows permuted
    fp8_pairs: tl.constexpr = SCHEME == 0 and DOT_DTYPE == tl.float16 and WORDS == BLOCK_D and WORDS % 16 == 0
    full = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    for start in range(lo, full, BLOCK_N):  # whole steps: no token masks
        acc, m_i, l_i = token_swapped_step(
            acc, m_i, l_i, q_t, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, codebook_ptr, indices_ptr, logits_ptr, b,
            page_lo, start, hi, h, stride_lb, stride_lh, scale_log2, offs_d, mask_g, mask_d, heads,
            SCHEME, BITS, CPW, WORDS, NUM_KV_HEADS, PAGE_SIZE, LOGITS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE,
            PRECISION, False, fp8_pairs,
        )  # fmt: skip
    if full < hi:  # the list's last, partial step
        acc, m_i, l_i = token_swapped_step(
            acc, m_i, l_i, q_t, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, codebook_ptr, indices_ptr, logits_ptr, b,
            page_lo, full, hi, h, stride_lb, stride_lh, scale_log2, offs_d, mask_g, mask_d, heads,
            SCHEME, BITS, CPW, WORDS, NUM_KV_HEADS, PAGE_SIZE, LOGITS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE,
            PRECISION, True, fp8_pairs,
        )  # fmt: skip
    chan = offs_d
    if fp8_pairs:
        chan = fp8_pair_rows(BLOCK_D)
    store_partial(o_part_ptr, lse_part_ptr, acc, m_i, l_i, b, split, num_splits, heads, chan, mask_g, mask_d,
                  NUM_KV_HEADS, GROUP, BLOCK_D, True)  # fmt: skip


def _quantized_decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_min_ptr,
    v_min_ptr,
    k_tail_ptr,
    v_tail_ptr,
    codebook_ptr,
    indptr_ptr,
    indices_ptr,
    last_len_ptr,
    tail_index_ptr,
    o_part_ptr,
    lse_part_ptr,
    logits_ptr,
    stride_qb,
    stride_qh,
    stride_lb,
    stride_lh,
    scale_log2,
    num_splits,
    SCHEME: tl.constexpr,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_SPARSE: tl.constexpr,
    LOGITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
    PAIRS: tl.constexpr = False,
    GROUPED: tl.constexpr = False,
):
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
    if lo < kv_len:
        pdl_enter(USE_GDC)
        hi = tl.minimum(lo + chunk, kv_len)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = h * GROUP + offs_g
        if SWAP_AB and SCHEME != 1:
            token_swapped(
                q_ptr + b * stride_qb, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, codebook_ptr, indices_ptr, o_part_ptr,
                lse_part_ptr, logits_ptr, b, split, page_lo, lo, hi, h, stride_qh, stride_lb, stride_lh, scale_log2,
                num_splits, offs_g, offs_d, mask_g, mask_d, heads,
                SCHEME, BITS, CPW, WORDS, NUM_KV_HEADS, GROUP, PAGE_SIZE, LOGITS, BLOCK_D, BLOCK_N, UNPACK_WORDS,
                DOT_DTYPE, PRECISION,
            )  # fmt: skip
        elif SWAP_AB:  # KIVI
            kivi_swapped(
                q_ptr + b * stride_qb, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_min_ptr, v_min_ptr, k_tail_ptr,
                v_tail_ptr, indices_ptr, tail_index_ptr, o_part_ptr, lse_part_ptr, b, h, split, page_lo, lo, hi,
                kv_len, stride_qh, scale_log2, num_splits, offs_g, offs_d, mask_g, mask_d, heads,
                BITS, CPW, WORDS, NUM_GROUPS, NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_G, BLOCK_D, BLOCK_N,
                UNPACK_WORDS, DOT_DTYPE, PRECISION, PAIRS, GROUPED,
            )  # fmt: skip
        else:
            q = tl.load(
                q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_G, BLOCK_D]
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            if SCHEME == 1:  # KIVI: full pages from codes, the incomplete last page from the tail
                q_scaled = q * scale_log2
                full = (kv_len // PAGE_SIZE) * PAGE_SIZE
                offs_t = tl.arange(0, BLOCK_N)
                for start in range(lo, tl.minimum(hi, full), BLOCK_N):
                    block = tl.load(indices_ptr + page_lo + start // PAGE_SIZE).to(tl.int64)
                    rows = (block * PAGE_SIZE + offs_t) * NUM_KV_HEADS + h
                    s = kivi_key_page(
                        q_scaled, k_ptr, k_scale_ptr, k_min_ptr, block, h, rows, offs_d, mask_d,
                        BITS, CPW, WORDS, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE, PRECISION,
                    )  # fmt: skip
                    p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
                    v = kivi_value_tile(
                        v_ptr, v_scale_ptr, v_min_ptr, rows, offs_d, offs_t < BLOCK_N, mask_d,
                        BITS, CPW, WORDS, NUM_GROUPS, PAGE_SIZE, BLOCK_D, BLOCK_N, UNPACK_WORDS,
                        DOT_DTYPE == tl.float16,
                    )  # fmt: skip
                    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
                if hi > full:  # this split holds the tail (hi == kv_len; full is page-aligned, so full >= lo)
                    tail = tl.load(tail_index_ptr + b).to(tl.int64)
                    mask_n = full + offs_t < hi
                    rows = ((tail * PAGE_SIZE + offs_t) * NUM_KV_HEADS + h) * HEAD_DIM
                    both_t = mask_n[None, :] & mask_d[:, None]
                    k = tl.load(k_tail_ptr + rows[None, :] + offs_d[:, None], mask=both_t, other=0.0)  # [D, N]
                    s = tl.dot(q_scaled.to(DOT_DTYPE), k.to(DOT_DTYPE), input_precision=PRECISION)
                    s = tl.where(mask_n[None, :], s, float("-inf"))
                    p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
                    both = mask_n[:, None] & mask_d[None, :]
                    v = tl.load(v_tail_ptr + rows[:, None] + offs_d[None, :], mask=both, other=0.0)
                    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
            else:  # fp8 / TurboQuant: codes per token, one scale per (token, head)
                q_dot = q.to(DOT_DTYPE)
                for start in range(lo, hi, BLOCK_N):
                    offs_n = start + tl.arange(0, BLOCK_N)
                    mask_n = offs_n < hi
                    rows, s = token_scores(
                        q_dot, k_ptr, k_scale_ptr, codebook_ptr, indices_ptr, page_lo, start, hi, offs_n, mask_n, h,
                        offs_d, mask_d, scale_log2, SCHEME, BITS, CPW, WORDS, PAGE_SIZE, NUM_KV_HEADS, BLOCK_D, BLOCK_N,
                        UNPACK_WORDS, DOT_DTYPE, PRECISION,
                    )  # fmt: skip
                    if LOGITS:
                        store_logits(logits_ptr, b, heads, offs_n, s, stride_lb, stride_lh, mask_g, mask_n)
                    p, alpha, l_i, m_i = online_softmax(tl.where(mask_n[None, :], s, float("-inf")), m_i, l_i)
                    acc = token_values(
                        acc, p, alpha, v_ptr, v_scale_ptr, codebook_ptr, rows, offs_d, mask_n, mask_d,
                        SCHEME, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE, PRECISION,
                    )  # fmt: skip
            store_partial(o_part_ptr, lse_part_ptr, acc, m_i, l_i, b, split, num_splits, heads, offs_d, mask_g, mask_d,
                          NUM_KV_HEADS, GROUP, BLOCK_D)  # fmt: skip
        pdl_exit(USE_GDC)


quantized_decode_split_kernel = Kernel(_quantized_decode_split_kernel)
