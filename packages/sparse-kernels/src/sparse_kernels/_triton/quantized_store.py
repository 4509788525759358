"""Triton ``store_kv_quantized``: one program per (row, KV head); rows with slot ``-1`` return at once.

Every float step is the reference's own (``kv_quant``): IEEE division (``div_rn``) and square root,
and fp8 rounding done on the bits, because the interpreter's fp32 -> e4m3 cast does not round to
nearest even (the GPU's ``cvt.rn.satfinite`` does). Packed words are OR-reduced, so a code in the
sign bit needs no overflowing add.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_enter, pdl_exit


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _pack(codes, shifts, AXIS: tl.constexpr):
    """int32 codes -> words: OR of ``codes << shifts`` along ``AXIS`` (the codes of one word)."""
    return tl.reduce(codes << shifts, AXIS, _bit_or)


@triton.jit
def _e4m3_bits(y):
    """The float8_e4m3fn byte (as int32) of float32 ``y`` with ``|y| <= 448``, rounded to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal e4m3 (|y| >= 2**-6): round the low 20 mantissa bits away, then rebias the exponent 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal: round(|y| * 2**9) to even; 8 there is the smallest normal, whose byte is also 8.
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - (a >> 23), 30)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return tl.where(a >= (121 << 23), normal, q) | sign


@triton.jit
def _fp8_row(src_ptr, dst_ptr, scale_ptr, static_scale, offs_d, mask_d, STATIC: tl.constexpr):
    x = tl.load(src_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if STATIC:
        s = static_scale
    else:
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), 1e-12)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
    tl.store(dst_ptr + offs_d, _e4m3_bits(y).to(tl.uint8), mask=mask_d)
    tl.store(scale_ptr, s)


def _store_fp8_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh, k_static, v_static,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STATIC: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    row, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        pdl_enter(USE_GDC)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        dst = (slot * NUM_KV_HEADS + h) * HEAD_DIM
        sc = slot * NUM_KV_HEADS + h
        _fp8_row(
            key_ptr + row * stride_kn + h * stride_kh, k_ptr + dst, k_scale_ptr + sc, k_static, offs_d, mask_d, STATIC
        )
        _fp8_row(
            value_ptr + row * stride_vn + h * stride_vh, v_ptr + dst, v_scale_ptr + sc, v_static, offs_d, mask_d, STATIC
        )
        pdl_exit(USE_GDC)


@triton.jit
def _turboquant_row(src_ptr, dst_ptr, scale_ptr, codebook_ptr, offs_w, offs_c, BITS: tl.constexpr, CPW: tl.constexpr,
                    HEAD_DIM: tl.constexpr, NUM_WORDS: tl.constexpr):  # fmt: skip
    d = offs_w[:, None] * CPW + offs_c[None, :]  # [BLOCK_W, BLOCK_C]: channel of each code of each word
    mask = (offs_c[None, :] < CPW) & (d < HEAD_DIM)
    x = tl.load(src_ptr + d, mask=mask, other=0.0)
    s = tl.maximum(tl.sqrt_rn(tl.math.div_rn(tl.sum(tl.sum(x * x, axis=1), axis=0), HEAD_DIM * 1.0)), 1e-30)
    y = tl.math.div_rn(x, s)
    codes = tl.zeros_like(d)
    for j in tl.static_range(2**BITS - 1):  # the number of midpoints y exceeds
        mid = (tl.load(codebook_ptr + j) + tl.load(codebook_ptr + j + 1)) / 2
        codes += (y > mid).to(tl.int32)
    codes = tl.where(mask, codes, 0)
    shifts = tl.where(offs_c < CPW, offs_c * BITS, 0)
    tl.store(dst_ptr + offs_w, _pack(codes, shifts[None, :], 1), mask=offs_w < NUM_WORDS)
    tl.store(scale_ptr, s)


def _store_turboquant_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, codebook_ptr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, CPW: tl.constexpr,
    NUM_WORDS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    row, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        pdl_enter(USE_GDC)
        offs_w, offs_c = tl.arange(0, BLOCK_W), tl.arange(0, BLOCK_C)
        src = (row * NUM_KV_HEADS + h) * HEAD_DIM  # the rotated rows: float32 [N, H, D], contiguous
        dst = (slot * NUM_KV_HEADS + h) * NUM_WORDS
        sc = slot * NUM_KV_HEADS + h
        _turboquant_row(key_ptr + src, k_ptr + dst, k_scale_ptr + sc, codebook_ptr, offs_w, offs_c,
                        BITS, CPW, HEAD_DIM, NUM_WORDS)  # fmt: skip
        _turboquant_row(value_ptr + src, v_ptr + dst, v_scale_ptr + sc, codebook_ptr, offs_w, offs_c,
                        BITS, CPW, HEAD_DIM, NUM_WORDS)  # fmt: skip
        pdl_exit(USE_GDC)


@triton.jit
def _kivi_stats(mn, mx, BITS: tl.constexpr):
    """KIVI's stored ``(scale, zero)`` (float16) of a group's float32 min and max."""
    levels: tl.constexpr = 2**BITS - 1
    scale = tl.maximum(tl.math.div_rn(mx - mn, levels * 1.0), 2.0**-24).to(tl.float16)
    return scale, mn.to(tl.float16)


@triton.jit
def _kivi_codes(x, scale, zero, BITS: tl.constexpr):
    """int32 codes of float32 ``x`` against broadcastable stored ``scale`` / ``zero``."""
    levels: tl.constexpr = 2**BITS - 1
    q = tl.floor(tl.math.div_rn(x - zero.to(tl.float32), scale.to(tl.float32)) + 0.5)
    return tl.minimum(tl.maximum(q, 0.0), levels * 1.0).to(tl.int32)


def _store_kivi_decode_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, k_scale_ptr, k_min_ptr, v_scale_ptr, v_min_ptr, k_tail_ptr, v_tail_ptr,
    slot_ptr, tail_index_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    row, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        tail = tl.load(tail_index_ptr + row).to(tl.int64)
        pdl_enter(USE_GDC)
        block, offset = slot // PAGE, slot % PAGE
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        xk = tl.load(key_ptr + row * stride_kn + h * stride_kh + offs_d, mask=mask_d, other=0.0)
        xv = tl.load(value_ptr + row * stride_vn + h * stride_vh + offs_d, mask=mask_d, other=0.0)
        if offset < PAGE - 1:
            dst = ((tail * PAGE + offset) * NUM_KV_HEADS + h) * HEAD_DIM + offs_d
            tl.store(k_tail_ptr + dst, xk, mask=mask_d)
            tl.store(v_tail_ptr + dst, xv, mask=mask_d)
        else:  # this row fills the page: encode the tail's PAGE - 1 tokens plus this row
            _kivi_encode_keys(k_ptr, k_scale_ptr, k_min_ptr, k_tail_ptr, xk, block, tail, h,
                              NUM_KV_HEADS, HEAD_DIM, PAGE, BITS, BLOCK_D)  # fmt: skip
            _kivi_encode_values(v_ptr, v_scale_ptr, v_min_ptr, v_tail_ptr, xv, block, tail, h,
                                NUM_KV_HEADS, HEAD_DIM, PAGE, BITS, BLOCK_D)  # fmt: skip
        pdl_exit(USE_GDC)


@triton.jit
def _page_tile(tail_ptr, x, tail, h, offs_s, offs_d, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               PAGE: tl.constexpr):  # fmt: skip
    """The page as float32 ``[PAGE, BLOCK_D]``: tail rows ``0..PAGE-2`` and ``x`` (in registers) last."""
    mask = (offs_s[:, None] < PAGE - 1) & (offs_d[None, :] < HEAD_DIM)
    src = ((tail * PAGE + offs_s[:, None]) * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
    page = tl.load(tail_ptr + src, mask=mask, other=0.0)
    return tl.where(offs_s[:, None] == PAGE - 1, x[None, :], page).to(tl.float32)


@triton.jit
def _kivi_encode_keys(codes_ptr, scale_ptr, min_ptr, tail_ptr, x, block, tail, h,
                      NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
                      BLOCK_D: tl.constexpr):  # fmt: skip
    cpw: tl.constexpr = 32 // BITS
    offs_s, offs_d = tl.arange(0, PAGE), tl.arange(0, BLOCK_D)
    page = _page_tile(tail_ptr, x, tail, h, offs_s, offs_d, NUM_KV_HEADS, HEAD_DIM, PAGE)
    mn, mx = tl.min(page, axis=0), tl.max(page, axis=0)  # per channel over the page's tokens
    scale, zero = _kivi_stats(mn, mx, BITS)
    codes = _kivi_codes(page, scale[None, :], zero[None, :], BITS)
    stat = (block * NUM_KV_HEADS + h) * HEAD_DIM + offs_d
    tl.store(scale_ptr + stat, scale, mask=offs_d < HEAD_DIM)
    tl.store(min_ptr + stat, zero, mask=offs_d < HEAD_DIM)
    _store_words(codes_ptr, codes, block, h, NUM_KV_HEADS, HEAD_DIM, PAGE, BITS, BLOCK_D // cpw, cpw)


@triton.jit
def _kivi_encode_values(codes_ptr, scale_ptr, min_ptr, tail_ptr, x, block, tail, h,
                        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
                      BLOCK_D: tl.constexpr):  # fmt: skip
    cpw: tl.constexpr = 32 // BITS
    groups: tl.constexpr = BLOCK_D // PAGE  # KIVI's group is the page size: whole groups, even the padded ones
    offs_s, offs_d = tl.arange(0, PAGE), tl.arange(0, BLOCK_D)
    page = tl.reshape(
        _page_tile(tail_ptr, x, tail, h, offs_s, offs_d, NUM_KV_HEADS, HEAD_DIM, PAGE), (PAGE, groups, PAGE)
    )
    mn, mx = tl.min(page, axis=2), tl.max(page, axis=2)  # per token over each group's channels
    scale, zero = _kivi_stats(mn, mx, BITS)
    codes = _kivi_codes(page, scale[:, :, None], zero[:, :, None], BITS)
    offs_g = tl.arange(0, groups)
    num_groups = HEAD_DIM // PAGE
    stat = ((block * PAGE + offs_s[:, None]) * NUM_KV_HEADS + h) * num_groups + offs_g[None, :]
    tl.store(scale_ptr + stat, scale, mask=offs_g[None, :] < num_groups)
    tl.store(min_ptr + stat, zero, mask=offs_g[None, :] < num_groups)
    _store_words(codes_ptr, tl.reshape(codes, (PAGE, BLOCK_D)), block, h, NUM_KV_HEADS, HEAD_DIM, PAGE, BITS,
                 BLOCK_D // cpw, cpw)  # fmt: skip


@triton.jit
def _store_words(codes_ptr, codes, block, h, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr, CPW: tl.constexpr):  # fmt: skip
    """Pack ``[PAGE, BLOCK_D]`` codes (``BLOCK_D = BLOCK_W * CPW``) into the page's words of head ``h``."""
    num_words = HEAD_DIM // CPW
    shifts = tl.arange(0, CPW) * BITS
    words = _pack(tl.reshape(codes, (PAGE, BLOCK_W, CPW)), shifts[None, None, :], 2)
    offs_s, offs_w = tl.arange(0, PAGE), tl.arange(0, BLOCK_W)
    dst = ((block * PAGE + offs_s[:, None]) * NUM_KV_HEADS + h) * num_words + offs_w[None, :]
    tl.store(codes_ptr + dst, words, mask=offs_w[None, :] < num_words)


store_fp8_kernel = Kernel(_store_fp8_kernel)
store_turboquant_kernel = Kernel(_store_turboquant_kernel)
store_kivi_decode_kernel = Kernel(_store_kivi_decode_kernel)
