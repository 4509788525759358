"""Split-K decode over 2- and 4-bit codes (KIVI, TurboQuant) by bit planes: no tile reshapes.

``quantized_decode.py`` unpacks a tile of codes into ``[channels, tokens]`` with a reshape, which Triton
lowers through shared memory (a store and a load per element). Here a row's codes are read as ``U =
head_dim / 4`` units of 4 codes (4-bit: half-words; 2-bit: bytes) and split into 4 planes: plane ``j``
holds channel ``4u + j`` of unit ``u``. Each plane is an elementwise function of the loaded units, so
it can be computed in the layout the dot wants; the query is loaded as 4 matching column planes, the
scores are a sum of 4 dots with ``K = U``, and the output accumulates in 4 planes, stored strided.
Needs ``U >= 16`` (``head_dim >= 64``). Everything else (grid, splits, KIVI's pages and tail,
TurboQuant's per-token scales) is as in ``quantized_decode.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_enter, pdl_exit
from sparse_kernels._triton.quantized_tiles import code_float, online_softmax


@triton.jit
def _units(ptr, rows, offs_u, mask, BITS: tl.constexpr, WORDS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """int32 units (4 codes in the low bits) of ``rows``: ``[U, N]`` transposed, else ``[N, U]``."""
    word = offs_u * BITS // 8  # 4 codes of BITS bits per unit: 4 * BITS // 32 words per unit
    shift = (offs_u * 4 * BITS) % 32
    if TRANSPOSED:
        words = tl.load(ptr + rows[None, :] * WORDS + word[:, None], mask=mask[None, :], other=0)
        return words >> shift[:, None]
    else:
        words = tl.load(ptr + rows[:, None] * WORDS + word[None, :], mask=mask[:, None], other=0)
        return words >> shift[None, :]


@triton.jit
def _plane(units, J: tl.constexpr, BITS: tl.constexpr):
    return (units >> (J * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _level(codes, codebook_ptr, SCHEME: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A plane's values before scales: KIVI's codes as floats, TurboQuant's codebook levels."""
    if SCHEME == 1:
        return code_float(codes).to(DOT_DTYPE)
    else:
        return tl.load(codebook_ptr + codes).to(DOT_DTYPE)


@triton.jit
def _key_scores(q0, q1, q2, q3, units, codebook_ptr, SCHEME, BITS, DOT_DTYPE, PRECISION):
    """``sum_j q_j @ plane_j`` over the 4 planes of transposed key units ``[U, N]``."""
    s = tl.dot(q0, _level(_plane(units, 0, BITS), codebook_ptr, SCHEME, DOT_DTYPE), input_precision=PRECISION)
    s += tl.dot(q1, _level(_plane(units, 1, BITS), codebook_ptr, SCHEME, DOT_DTYPE), input_precision=PRECISION)
    s += tl.dot(q2, _level(_plane(units, 2, BITS), codebook_ptr, SCHEME, DOT_DTYPE), input_precision=PRECISION)
    s += tl.dot(q3, _level(_plane(units, 3, BITS), codebook_ptr, SCHEME, DOT_DTYPE), input_precision=PRECISION)
    return s


@triton.jit
def _value_plane(units, J: tl.constexpr, codebook_ptr, v_scale, v_zero, SCHEME: tl.constexpr, BITS, DOT_DTYPE):
    codes = _plane(units, J, BITS)
    if SCHEME == 1:  # KIVI: per (token, channel group) statistics, one value per unit
        return (code_float(codes) * v_scale + v_zero).to(DOT_DTYPE)
    else:
        return tl.load(codebook_ptr + codes).to(DOT_DTYPE)


@triton.jit
def _q_plane(q_ptr, base, heads, stride_qh, offs_u, mask_g, J: tl.constexpr):
    return tl.load(
        q_ptr + base + heads[:, None] * stride_qh + (offs_u * 4 + J)[None, :], mask=mask_g[:, None], other=0.0
    )


def _quantized_planes_split_kernel(
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
    stride_qb,
    stride_qh,
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
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
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
    page_lo = tl.load(indptr_ptr + lst)
    page_hi = tl.load(indptr_ptr + lst + 1)
    kv_len = (page_hi - page_lo - 1) * PAGE_SIZE + tl.load(last_len_ptr + lst)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    if lo < kv_len:
        pdl_enter(USE_GDC)
        hi = tl.minimum(lo + chunk, kv_len)
        offs_g = tl.arange(0, BLOCK_G)
        offs_u = tl.arange(0, HEAD_DIM // 4)
        offs_t = tl.arange(0, BLOCK_N)
        mask_g = offs_g < GROUP
        heads = h * GROUP + offs_g
        base = b * stride_qb
        q0 = _q_plane(q_ptr, base, heads, stride_qh, offs_u, mask_g, 0).to(tl.float32) * scale_log2
        q1 = _q_plane(q_ptr, base, heads, stride_qh, offs_u, mask_g, 1).to(tl.float32) * scale_log2
        q2 = _q_plane(q_ptr, base, heads, stride_qh, offs_u, mask_g, 2).to(tl.float32) * scale_log2
        q3 = _q_plane(q_ptr, base, heads, stride_qh, offs_u, mask_g, 3).to(tl.float32) * scale_log2
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc0 = tl.zeros([BLOCK_G, HEAD_DIM // 4], tl.float32)
        acc1 = tl.zeros([BLOCK_G, HEAD_DIM // 4], tl.float32)
        acc2 = tl.zeros([BLOCK_G, HEAD_DIM // 4], tl.float32)
        acc3 = tl.zeros([BLOCK_G, HEAD_DIM // 4], tl.float32)
        if SCHEME == 1:  # KIVI: one page per step; keys' per-channel statistics folded into the query
            full = (kv_len // PAGE_SIZE) * PAGE_SIZE
            body_hi = tl.minimum(hi, full)
        else:
            body_hi = hi
        for start in range(lo, body_hi, BLOCK_N):
            offs_n = start + offs_t
            mask_n = offs_n < body_hi
            if SCHEME == 1:
                block = tl.load(indices_ptr + page_lo + start // PAGE_SIZE).to(tl.int64)
                rows = (block * PAGE_SIZE + offs_t) * NUM_KV_HEADS + h
                stat = (block * NUM_KV_HEADS + h) * HEAD_DIM + offs_u * 4
                ks0 = tl.load(k_scale_ptr + stat).to(tl.float32)
                ks1 = tl.load(k_scale_ptr + stat + 1).to(tl.float32)
                ks2 = tl.load(k_scale_ptr + stat + 2).to(tl.float32)
                ks3 = tl.load(k_scale_ptr + stat + 3).to(tl.float32)
                kz0 = tl.load(k_min_ptr + stat).to(tl.float32)
                kz1 = tl.load(k_min_ptr + stat + 1).to(tl.float32)
                kz2 = tl.load(k_min_ptr + stat + 2).to(tl.float32)
                kz3 = tl.load(k_min_ptr + stat + 3).to(tl.float32)
                q_zero = tl.sum(q0 * kz0[None, :] + q1 * kz1[None, :] + q2 * kz2[None, :] + q3 * kz3[None, :], 1)
                units = _units(k_ptr, rows, offs_u, mask_n, BITS, WORDS, True)
                s = _key_scores(
                    (q0 * ks0[None, :]).to(DOT_DTYPE), (q1 * ks1[None, :]).to(DOT_DTYPE),
                    (q2 * ks2[None, :]).to(DOT_DTYPE), (q3 * ks3[None, :]).to(DOT_DTYPE),
                    units, codebook_ptr, SCHEME, BITS, DOT_DTYPE, PRECISION,
                )  # fmt: skip
                s += q_zero[:, None]
                p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
                pv = p.to(DOT_DTYPE)
                vstat = rows[:, None] * NUM_GROUPS + (offs_u * 4 // PAGE_SIZE)[None, :]
                v_scale = tl.load(v_scale_ptr + vstat).to(tl.float32)
                v_zero = tl.load(v_min_ptr + vstat).to(tl.float32)
            else:  # TurboQuant: any list kind, per-token scales on the scores and the probabilities
                page = tl.load(indices_ptr + page_lo + offs_n // PAGE_SIZE, mask=mask_n, other=0)
                rows = (page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE) * NUM_KV_HEADS + h
                k_scale = tl.load(k_scale_ptr + rows, mask=mask_n, other=0.0)
                units = _units(k_ptr, rows, offs_u, mask_n, BITS, WORDS, True)
                s = _key_scores(
                    q0.to(DOT_DTYPE), q1.to(DOT_DTYPE), q2.to(DOT_DTYPE), q3.to(DOT_DTYPE),
                    units, codebook_ptr, SCHEME, BITS, DOT_DTYPE, PRECISION,
                )  # fmt: skip
                s = tl.where(mask_n[None, :], s * k_scale[None, :], float("-inf"))
                p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
                pv = (p * tl.load(v_scale_ptr + rows, mask=mask_n, other=0.0)[None, :]).to(DOT_DTYPE)
                v_scale = 1.0
                v_zero = 0.0
            vu = _units(v_ptr, rows, offs_u, mask_n, BITS, WORDS, False)
            v0 = _value_plane(vu, 0, codebook_ptr, v_scale, v_zero, SCHEME, BITS, DOT_DTYPE)
            acc0 = acc0 * alpha[:, None] + tl.dot(pv, v0, input_precision=PRECISION)
            v1 = _value_plane(vu, 1, codebook_ptr, v_scale, v_zero, SCHEME, BITS, DOT_DTYPE)
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1, input_precision=PRECISION)
            v2 = _value_plane(vu, 2, codebook_ptr, v_scale, v_zero, SCHEME, BITS, DOT_DTYPE)
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2, input_precision=PRECISION)
            v3 = _value_plane(vu, 3, codebook_ptr, v_scale, v_zero, SCHEME, BITS, DOT_DTYPE)
            acc3 = acc3 * alpha[:, None] + tl.dot(pv, v3, input_precision=PRECISION)
        if SCHEME == 1:
            if hi > full:  # the incomplete last page, from the request's tail row
                tail = tl.load(tail_index_ptr + b).to(tl.int64)
                mask_n = full + offs_t < hi
                trow = ((tail * PAGE_SIZE + offs_t) * NUM_KV_HEADS + h) * HEAD_DIM
                kt = k_tail_ptr + trow[None, :] + offs_u[:, None] * 4  # [U, N]
                km = mask_n[None, :]
                s = tl.dot(q0.to(DOT_DTYPE), tl.load(kt, mask=km, other=0.0).to(DOT_DTYPE), input_precision=PRECISION)
                s += tl.dot(
                    q1.to(DOT_DTYPE), tl.load(kt + 1, mask=km, other=0.0).to(DOT_DTYPE), input_precision=PRECISION
                )
                s += tl.dot(
                    q2.to(DOT_DTYPE), tl.load(kt + 2, mask=km, other=0.0).to(DOT_DTYPE), input_precision=PRECISION
                )
                s += tl.dot(
                    q3.to(DOT_DTYPE), tl.load(kt + 3, mask=km, other=0.0).to(DOT_DTYPE), input_precision=PRECISION
                )
                p, alpha, l_i, m_i = online_softmax(tl.where(km, s, float("-inf")), m_i, l_i)
                pv = p.to(DOT_DTYPE)
                vt = v_tail_ptr + trow[:, None] + offs_u[None, :] * 4  # [N, U]
                vm = mask_n[:, None]
                acc0 = acc0 * alpha[:, None] + tl.dot(
                    pv, tl.load(vt, mask=vm, other=0.0).to(DOT_DTYPE), input_precision=PRECISION
                )
                acc1 = acc1 * alpha[:, None] + tl.dot(
                    pv, tl.load(vt + 1, mask=vm, other=0.0).to(DOT_DTYPE), input_precision=PRECISION
                )
                acc2 = acc2 * alpha[:, None] + tl.dot(
                    pv, tl.load(vt + 2, mask=vm, other=0.0).to(DOT_DTYPE), input_precision=PRECISION
                )
                acc3 = acc3 * alpha[:, None] + tl.dot(
                    pv, tl.load(vt + 3, mask=vm, other=0.0).to(DOT_DTYPE), input_precision=PRECISION
                )
        row = (b * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split  # [BLOCK_G]
        out = o_part_ptr + row[:, None] * BLOCK_D + offs_u[None, :] * 4
        tl.store(out, acc0 / l_i[:, None], mask=mask_g[:, None])
        tl.store(out + 1, acc1 / l_i[:, None], mask=mask_g[:, None])
        tl.store(out + 2, acc2 / l_i[:, None], mask=mask_g[:, None])
        tl.store(out + 3, acc3 / l_i[:, None], mask=mask_g[:, None])
        tl.store(lse_part_ptr + row, m_i + tl.log2(l_i), mask=mask_g)
        pdl_exit(USE_GDC)


quantized_planes_split_kernel = Kernel(_quantized_planes_split_kernel)
