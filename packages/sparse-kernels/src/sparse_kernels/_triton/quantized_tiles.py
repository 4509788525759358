"""Register-level dequantization of quantized KV tiles (fp8, KIVI, TurboQuant), shared by decode and prefill.

A tile is ``BLOCK_N`` tokens of one KV head, addressed by ``rows`` = ``slot * num_kv_heads + head`` (the
index of one (token, head) in the codes tensor flattened to ``[rows, words]``). Keys come transposed,
``[BLOCK_D, BLOCK_N]``, so ``tl.dot(q, k)`` needs no transpose; values ``[BLOCK_N, BLOCK_D]``. Only
codes (and, by the callers, scales) are read: nothing is dequantized to memory.

Packed codes: channel ``d`` sits in word ``d // CPW`` at bit ``(d % CPW) * BITS``. With ``UNPACK_WORDS``
(``CPW`` a power of two and ``HEAD_DIM == BLOCK_D``) each word is loaded once, as part of a contiguous
row, and shifted into its ``CPW`` channels by a broadcast plus a reshape; otherwise every channel loads
its own word (the same addresses: the loads coalesce, but cost one instruction per channel).

Integer codes become floats without a conversion instruction: ``code | 0x4B000000`` is the float
``2**23 + code``, and subtracting ``2**23`` is exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8, KIVI, TURBOQUANT = 0, 1, 2
SCHEME_IDS = {"fp8": FP8, "kivi": KIVI, "turboquant": TURBOQUANT}
TURBOQUANT_ID = tl.constexpr(TURBOQUANT)  # readable inside other modules' kernels (a plain int global is not)


@triton.jit
def code_float(codes):
    """int32 codes in ``[0, 2**23)`` as exact float32 values (an OR and a subtraction)."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def code_half(codes):
    """int32 codes in ``[0, 1024)`` as exact float16 values: ``code | 0x6400`` is the half ``1024 + code``."""
    return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def half_pairs(words, shift, BITS: tl.constexpr):
    """The codes at bits ``[shift, shift + BITS)`` and ``[16 + shift, 16 + shift + BITS)`` of int32 ``words`` as two
    float16 tensors (exact small integers), in inline PTX that keeps each word's two halves together. Whole bytes of
    the shift go by a SHF (none below 8); one LOP3 keeps the rest's masked bits and ORs them into the mantissa of
    1024.0 (the half ``1024 + code * 2**k`` for a code at bit ``k`` of the low byte), and one HFMA2 times ``2**-k``
    plus ``-1024 * 2**-k`` leaves each code exactly. ``shift`` an int or an int32 tensor that broadcasts against
    ``words``, ``shift % 8 + BITS <= 8``. GPU only: the interpreter runs no PTX."""
    inner = shift % 8
    x = words >> (shift - inner)
    zero = tl.zeros(x.shape, tl.int32)
    mask = zero + (((1 << BITS) - 1) << inner) * ((1 << 16) + 1)
    mul = zero + (((0x3C00 - (inner << 10)) << 16) | (0x3C00 - (inner << 10)))
    add = zero + (((0xE400 - (inner << 10)) << 16) | (0xE400 - (inner << 10)))
    return tl.inline_asm_elementwise(
        asm="{ .reg .b32 t, c; mov.b32 c, 0x64006400; lop3.b32 t, $2, $3, c, 0xEA; fma.rn.f16x2 t, t, $4, $5;"
        " mov.b32 {$0, $1}, t; }",
        constraints="=h,=h,r,r,r,r",
        args=[x, mask, mul, add],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def key_codes(
    ptr,
    rows,
    offs_d,
    mask_n,
    mask_d,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
):
    """int32 codes ``[BLOCK_D, BLOCK_N]`` of the keys at ``rows`` (masked tokens read as code 0)."""
    if UNPACK_WORDS:
        offs_w = tl.arange(0, WORDS)
        words = tl.load(ptr + rows[None, :] * WORDS + offs_w[:, None], mask=mask_n[None, :], other=0)  # [W, N]
        shifts = tl.arange(0, CPW) * BITS
        codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [W, CPW, N]
        return tl.reshape(codes, [BLOCK_D, BLOCK_N])
    else:
        words = tl.load(
            ptr + rows[None, :] * WORDS + (offs_d // CPW)[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0
        )
        return (words >> ((offs_d % CPW) * BITS)[:, None]) & ((1 << BITS) - 1)


@triton.jit
def value_codes(
    ptr,
    rows,
    offs_d,
    mask_n,
    mask_d,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
):
    """int32 codes ``[BLOCK_N, BLOCK_D]`` of the values at ``rows``."""
    if UNPACK_WORDS:
        offs_w = tl.arange(0, WORDS)
        words = tl.load(ptr + rows[:, None] * WORDS + offs_w[None, :], mask=mask_n[:, None], other=0)  # [N, W]
        shifts = tl.arange(0, CPW) * BITS
        codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)  # [N, W, CPW]
        return tl.reshape(codes, [BLOCK_N, BLOCK_D])
    else:
        words = tl.load(
            ptr + rows[:, None] * WORDS + (offs_d // CPW)[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0
        )
        return (words >> ((offs_d % CPW) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def fp8_pair_codes(even, odd):
    """Two tokens' fp8 words (four channels each) as eight float16 tensors in inline PTX: two PRMTs interleave their
    bytes by channel, four ``cvt.rn.f16x2.e4m3x2`` convert each channel's token pair into one register (the MMA's
    reduction pair). Returns ``(even, odd)`` for channels 0, 1, 2, 3 of the word. GPU only (sm_89+)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .b32 a, b, r0, r1, r2, r3; .reg .b16 a0, a1, b0, b1;"
        " prmt.b32 a, $8, $9, 0x5140; prmt.b32 b, $8, $9, 0x7362; mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b;"
        " cvt.rn.f16x2.e4m3x2 r0, a0; cvt.rn.f16x2.e4m3x2 r1, a1; cvt.rn.f16x2.e4m3x2 r2, b0;"
        " cvt.rn.f16x2.e4m3x2 r3, b1; mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; mov.b32 {$4, $5}, r2;"
        " mov.b32 {$6, $7}, r3; }",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        args=[even, odd],
        dtype=(tl.float16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def fp8_value_pairs(v_ptr, rows, mask_n, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp8 values ``[HEAD_DIM, BLOCK_N]`` (channels as rows, the transposed dot's left operand) read as 32-bit words of
    token pairs and converted by ``fp8_pair_codes``, so that no byte is loaded alone (the generic loader's transposed
    fp8 tile cost a byte load from shared memory per two codes). GPU only."""
    W: tl.constexpr = HEAD_DIM // 4
    rows_even, rows_odd = tl.split(tl.reshape(rows, [BLOCK_N // 2, 2]))
    mask_even, mask_odd = tl.split(tl.reshape(mask_n, [BLOCK_N // 2, 2]))
    words = v_ptr.to(tl.pointer_type(tl.int32))
    offs_w = tl.arange(0, W)[None, :]
    even = tl.load(words + rows_even[:, None] * W + offs_w, mask=mask_even[:, None], other=0)  # [P, W]
    odd = tl.load(words + rows_odd[:, None] * W + offs_w, mask=mask_odd[:, None], other=0)
    e0, o0, e1, o1, e2, o2, e3, o3 = fp8_pair_codes(even, odd)
    tile = tl.join(tl.join(tl.join(e0, o0), tl.join(e1, o1)), tl.join(tl.join(e2, o2), tl.join(e3, o3)))
    # [P, g, wl, pair, bit 0, bit 1] (word w = 4g + wl, channel 4w + 2 * bit 1 + bit 0) -> rows ((4 wl + c) * G + g)
    G: tl.constexpr = W // 4
    tile = tl.reshape(tile, [BLOCK_N // 2, G, 4, 2, 2, 2])
    return tl.reshape(tl.permute(tile, (2, 5, 4, 1, 0, 3)), [HEAD_DIM, BLOCK_N])


@triton.jit
def fp8_pair_rows(HEAD_DIM: tl.constexpr):
    """The channel of each row of ``fp8_value_pairs``' tile: row ``j * G + g`` (``G = HEAD_DIM / 16``) holds channel
    ``16 g + j``, so that the rows an MMA lane owns (``g + 8 k``) are its words' own channels."""
    r = tl.arange(0, HEAD_DIM)
    G: tl.constexpr = HEAD_DIM // 16
    return (r % G) * 16 + r // G


@triton.jit
def token_key_tile(
    k_ptr,
    codebook_ptr,
    rows,
    offs_d,
    mask_n,
    mask_d,
    SCHEME: tl.constexpr,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Keys ``[BLOCK_D, BLOCK_N]`` of a per-token scheme before their scale: fp8 codes or codebook levels."""
    if SCHEME == 0:  # FP8
        k = tl.load(k_ptr + rows[None, :] * WORDS + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        return k.to(DOT_DTYPE)
    else:
        codes = key_codes(k_ptr, rows, offs_d, mask_n, mask_d, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS)
        return tl.load(codebook_ptr + codes).to(DOT_DTYPE)


@triton.jit
def token_value_tile(
    v_ptr,
    codebook_ptr,
    rows,
    offs_d,
    mask_n,
    mask_d,
    SCHEME: tl.constexpr,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Values ``[BLOCK_N, BLOCK_D]`` of a per-token scheme before their scale."""
    if SCHEME == 0:  # FP8
        v = tl.load(v_ptr + rows[:, None] * WORDS + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        return v.to(DOT_DTYPE)
    else:
        codes = value_codes(v_ptr, rows, offs_d, mask_n, mask_d, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS)
        return tl.load(codebook_ptr + codes).to(DOT_DTYPE)


@triton.jit
def step_rows(
    indices_ptr, page_lo, start, hi, offs_n, mask_n, h,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Rows (``slot * NUM_KV_HEADS + h``) of a step's tokens ``offs_n = start + arange(BLOCK_N)`` of a list (pages from
    ``indices_ptr[page_lo]``, ``start`` a multiple of ``BLOCK_N``, tokens from ``hi`` on masked). A step inside one
    page or over two takes their ids in one or two scalar loads, so a token's address is a page base plus its offset
    (each token's own load of its page id cost ~200 instructions of a 32-token fp8 step, sm_90 SASS); longer steps
    load a page id per token."""
    t = offs_n - start
    if BLOCK_N <= PAGE_SIZE and PAGE_SIZE % BLOCK_N == 0:
        block = tl.load(indices_ptr + page_lo + start // PAGE_SIZE).to(tl.int64)
        rows = (block * PAGE_SIZE + start % PAGE_SIZE + t) * NUM_KV_HEADS + h
    elif BLOCK_N == 2 * PAGE_SIZE:
        first = tl.load(indices_ptr + page_lo + start // PAGE_SIZE).to(tl.int64)
        second = tl.load(indices_ptr + page_lo + start // PAGE_SIZE + 1, mask=start + PAGE_SIZE < hi, other=0)
        rows = (tl.where(t < PAGE_SIZE, first, second.to(tl.int64)) * PAGE_SIZE + t % PAGE_SIZE) * NUM_KV_HEADS + h
    else:
        page = tl.load(indices_ptr + page_lo + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        rows = (page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE) * NUM_KV_HEADS + h
    return rows


@triton.jit
def token_scores(
    q_dot, k_ptr, k_scale_ptr, codebook_ptr, indices_ptr, page_lo, start, hi, offs_n, mask_n, h, offs_d, mask_d,
    scale_log2,
    SCHEME: tl.constexpr, BITS: tl.constexpr, CPW: tl.constexpr, WORDS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UNPACK_WORDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """A per-token scheme's step over the list's tokens ``offs_n = start + arange(BLOCK_N)`` (``step_rows``): their
    rows (``slot * NUM_KV_HEADS + h``) and the base-2 scores ``q_dot @ K`` ``[M, BLOCK_N]``, each token's key scale
    applied (fp8 / TurboQuant; the decode's and the prefill's loops)."""
    rows = step_rows(indices_ptr, page_lo, start, hi, offs_n, mask_n, h, PAGE_SIZE, NUM_KV_HEADS, BLOCK_N)
    k_scale = tl.load(k_scale_ptr + rows, mask=mask_n, other=0.0) * scale_log2
    k = token_key_tile(
        k_ptr, codebook_ptr, rows, offs_d, mask_n, mask_d,
        SCHEME, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE,
    )  # fmt: skip
    return rows, tl.dot(q_dot, k, input_precision=PRECISION) * k_scale[None, :]


@triton.jit
def token_values(
    acc, p, alpha, v_ptr, v_scale_ptr, codebook_ptr, rows, offs_d, mask_n, mask_d,
    SCHEME: tl.constexpr, BITS: tl.constexpr, CPW: tl.constexpr, WORDS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, UNPACK_WORDS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``token_scores``' step on the value side: ``acc [M, BLOCK_D]`` rescaled by ``alpha`` plus the probabilities
    ``p [M, BLOCK_N]`` (each token's value scale applied) times the tokens' values."""
    v_scale = tl.load(v_scale_ptr + rows, mask=mask_n, other=0.0)
    v = token_value_tile(
        v_ptr, codebook_ptr, rows, offs_d, mask_n, mask_d,
        SCHEME, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE,
    )  # fmt: skip
    return acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(DOT_DTYPE), v, input_precision=PRECISION)


@triton.jit
def kivi_value_tile(
    v_ptr,
    v_scale_ptr,
    v_min_ptr,
    rows,
    offs_d,
    mask_n,
    mask_d,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    HALF: tl.constexpr = False,
    TRANSPOSED: tl.constexpr = False,
):
    """KIVI values ``[BLOCK_N, BLOCK_D]``: ``code * scale + min`` per (token, channel group).

    Unpacking whole words, a word's ``CPW`` channels share one group (``CPW <= GROUP_SIZE``), so the
    statistics are loaded once per word and broadcast over its channels. ``HALF``: computed in float16
    (codes become halves without a conversion, the statistics are float16 already; for fp16 dots),
    else in float32. ``TRANSPOSED``: the tile as ``[BLOCK_D, BLOCK_N]`` (channels as rows), the left
    operand of ``V^T @ P^T``.
    """
    if UNPACK_WORDS:
        offs_w = tl.arange(0, WORDS)
        shifts = tl.arange(0, CPW) * BITS
        if TRANSPOSED:  # words [W, N] -> codes [CPW, W, N]: row j * W + w holds channel w * CPW + j
            words = tl.load(v_ptr + rows[None, :] * WORDS + offs_w[:, None], mask=mask_n[None, :], other=0)
            stat = rows[None, :] * NUM_GROUPS + (offs_w * CPW // GROUP_SIZE)[:, None]
            scale = tl.load(v_scale_ptr + stat, mask=mask_n[None, :], other=0.0)[None, :, :]
            zero = tl.load(v_min_ptr + stat, mask=mask_n[None, :], other=0.0)[None, :, :]
            codes = (words[None, :, :] >> shifts[:, None, None]) & ((1 << BITS) - 1)
            shape: tl.constexpr = [BLOCK_D, BLOCK_N]
        else:  # words [N, W] -> codes [N, W, CPW]
            words = tl.load(v_ptr + rows[:, None] * WORDS + offs_w[None, :], mask=mask_n[:, None], other=0)
            stat = rows[:, None] * NUM_GROUPS + (offs_w * CPW // GROUP_SIZE)[None, :]
            scale = tl.load(v_scale_ptr + stat, mask=mask_n[:, None], other=0.0)[:, :, None]
            zero = tl.load(v_min_ptr + stat, mask=mask_n[:, None], other=0.0)[:, :, None]
            codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
            shape: tl.constexpr = [BLOCK_N, BLOCK_D]
        if HALF:
            v = code_half(codes) * scale + zero
        else:
            v = code_float(codes) * scale.to(tl.float32) + zero.to(tl.float32)
        v = tl.reshape(v, shape)
    else:
        if TRANSPOSED:
            codes = key_codes(v_ptr, rows, offs_d, mask_n, mask_d, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS)
            stat = rows[None, :] * NUM_GROUPS + (offs_d // GROUP_SIZE)[:, None]
            both = mask_n[None, :] & mask_d[:, None]
        else:
            codes = value_codes(v_ptr, rows, offs_d, mask_n, mask_d, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS)
            stat = rows[:, None] * NUM_GROUPS + (offs_d // GROUP_SIZE)[None, :]
            both = mask_n[:, None] & mask_d[None, :]
        scale = tl.load(v_scale_ptr + stat, mask=both, other=0.0).to(tl.float32)
        zero = tl.load(v_min_ptr + stat, mask=both, other=0.0).to(tl.float32)
        v = code_float(codes) * scale + zero
    return v


@triton.jit
def kivi_value_pairs(
    v_ptr,
    v_scale_ptr,
    v_min_ptr,
    rows,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """KIVI values of one full page as two float16 tiles ``[CPW / 2 * WORDS, BLOCK_N]`` (channels as rows, through
    ``half_pairs``): row ``j * WORDS + w`` of the first holds channel ``w * CPW + j``, of the second ``w * CPW + CPW / 2
    + j`` (``pair_rows``); ``code * scale + min`` per (token, channel group)."""
    offs_w = tl.arange(0, WORDS)
    words = tl.load(v_ptr + rows[None, :] * WORDS + offs_w[:, None])  # [W, N]
    stat = rows[None, :] * NUM_GROUPS + (offs_w * CPW // GROUP_SIZE)[:, None]
    scale = tl.load(v_scale_ptr + stat)[None, :, :]
    zero = tl.load(v_min_ptr + stat)[None, :, :]
    low, high = half_pairs(words[None, :, :], (tl.arange(0, CPW // 2) * BITS)[:, None, None], BITS)
    shape: tl.constexpr = [CPW // 2 * WORDS, BLOCK_N]
    return tl.reshape(low * scale + zero, shape), tl.reshape(high * scale + zero, shape)


@triton.jit
def token_pair_words(even, odd):
    """Two tokens' packed words ``even`` and ``odd`` regrouped by half-word in inline PTX (two PRMTs): ``low`` holds
    the even token's bits 0-15 and the odd token's as its bits 16-31, ``high`` their bits 16-31 likewise, so that
    ``half_pairs`` of ``low`` at a shift gives one channel's code for both tokens, side by side in one register as
    an MMA's reduction pair. GPU only."""
    return tl.inline_asm_elementwise(
        asm="prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;",
        constraints="=r,=r,r,r",
        args=[even, odd],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def group_codes(words, shift, BITS: tl.constexpr, PTX: tl.constexpr):
    """Codes at ``shift`` of two tokens' regrouped words (``token_pair_words``) as ``(even, odd)`` float16 tensors;
    without ``PTX`` (the interpreter) the same values from plain integer ops, as float32."""
    if PTX:
        even, odd = half_pairs(words, shift, BITS)
    else:
        x = words >> shift
        even = code_float(x & ((1 << BITS) - 1))
        odd = code_float((x >> 16) & ((1 << BITS) - 1))
    return even, odd


@triton.jit
def kivi_group_values(
    acc_lo, acc_hi, z_acc, alpha, p, v_ptr, v_scale_ptr, v_min_ptr, rows_even, rows_odd, rows,
    BITS: tl.constexpr, CPW: tl.constexpr, WORDS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """One full KIVI page's values into grouped accumulators, the scales folded into the probabilities.

    ``v = code * scale + min`` per (token, channel group), so ``sum_t p_t v_t = sum_t (p_t * scale_tg) code_t +
    sum_t p_t min_tg``: the codes enter the dots as exact small integers, one dot per channel group ``g`` (batched)
    against its own probabilities ``p * scale[:, g]``, and the minima's term accumulates in ``z_acc [NUM_GROUPS,
    G]``. A token pair's codes of one channel share a register (``token_pair_words``), the MMA's reduction pair, so
    the tile needs no shuffle. ``acc_lo`` / ``acc_hi`` ``[NUM_GROUPS, CPW / 2 * WPG, G]``: row ``j * WPG + v`` of
    group ``g`` is channel ``(g * WPG + v) * CPW + j`` (``acc_hi``: ``+ CPW / 2``), ``WPG = GROUP_SIZE / CPW`` words
    a group. ``rows_even`` / ``rows_odd`` ``[BLOCK_N / 2]`` the pairs' code rows, ``rows`` ``[BLOCK_N]`` all of them
    in order; ``p`` ``[BLOCK_N, G]`` the page's probabilities."""
    WPG: tl.constexpr = GROUP_SIZE // CPW
    HALF: tl.constexpr = CPW // 2
    ROWS: tl.constexpr = HALF * WPG
    offs_g = tl.arange(0, NUM_GROUPS)
    word = offs_g[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [NG, WPG]
    even = tl.load(v_ptr + (rows_even * WORDS)[:, None, None] + word[None, :, :])  # [P, NG, WPG]
    odd = tl.load(v_ptr + (rows_odd * WORDS)[:, None, None] + word[None, :, :])
    if PTX:
        low, high = token_pair_words(even, odd)
    else:
        low = (even & 0xFFFF) | (odd << 16)
        high = ((even >> 16) & 0xFFFF) | (odd & -65536)
    shifts = (tl.arange(0, HALF) * BITS)[:, None, None, None]
    stat = rows[None, :] * NUM_GROUPS + offs_g[:, None]  # [NG, BLOCK_N]
    scale = tl.load(v_scale_ptr + stat).to(tl.float32)
    zero = tl.load(v_min_ptr + stat)
    p_dot = p.to(DOT_DTYPE)
    z_acc = z_acc * alpha[None, :] + tl.dot(zero.to(DOT_DTYPE), p_dot, input_precision=PRECISION)
    p_g = (scale[:, :, None] * p[None, :, :]).to(DOT_DTYPE)  # [NG, BLOCK_N, G]
    e, o = group_codes(low[None], shifts, BITS, PTX)  # [HALF, P, NG, WPG]
    v = tl.reshape(tl.permute(tl.join(e, o), (2, 0, 3, 1, 4)), [NUM_GROUPS, ROWS, BLOCK_N])
    acc_lo = acc_lo * alpha[None, None, :] + tl.dot(v.to(DOT_DTYPE), p_g, input_precision=PRECISION)
    e, o = group_codes(high[None], shifts, BITS, PTX)
    v = tl.reshape(tl.permute(tl.join(e, o), (2, 0, 3, 1, 4)), [NUM_GROUPS, ROWS, BLOCK_N])
    acc_hi = acc_hi * alpha[None, None, :] + tl.dot(v.to(DOT_DTYPE), p_g, input_precision=PRECISION)
    return acc_lo, acc_hi, z_acc


@triton.jit
def group_rows(NUM_GROUPS: tl.constexpr, CPW: tl.constexpr, WPG: tl.constexpr):
    """The channel of each row of ``kivi_group_values``' ``acc_lo`` flattened to ``[NUM_GROUPS * CPW / 2 * WPG]``
    (``acc_hi``'s are ``CPW / 2`` more)."""
    r = tl.arange(0, NUM_GROUPS * (CPW // 2) * WPG)
    g = r // ((CPW // 2) * WPG)
    within = r % ((CPW // 2) * WPG)
    return (g * WPG + within % WPG) * CPW + within // WPG


@triton.jit
def pair_rows(CPW: tl.constexpr, WORDS: tl.constexpr):
    """The channels of the first of ``kivi_value_pairs``' tiles by row (the second's are ``CPW // 2`` more)."""
    r = tl.arange(0, CPW // 2 * WORDS)
    return (r % WORDS) * CPW + r // WORDS


@triton.jit
def transposed_rows(offs_d, CPW: tl.constexpr, WORDS: tl.constexpr, UNPACK_WORDS: tl.constexpr):
    """The channel of each row of a ``TRANSPOSED`` KIVI value tile (``offs_d`` itself without ``UNPACK_WORDS``)."""
    if UNPACK_WORDS:
        chan = (offs_d % WORDS) * CPW + offs_d // WORDS
    else:
        chan = offs_d
    return chan


@triton.jit
def kivi_key_slices(
    q_row_ptr,
    heads,
    mask_g,
    stride_qh,
    scale_log2,
    k_ptr,
    k_scale_ptr,
    k_min_ptr,
    block,
    h,
    rows,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PAIRS: tl.constexpr = False,
):
    """Scores ``K @ q`` ``[BLOCK_N, BLOCK_G]`` over one full KIVI page, one dot per bit position of the packed words.

    Shift ``j`` of the page's words ``[BLOCK_N, WORDS]`` holds channels ``w * CPW + j``: its codes meet the queries'
    rows of those channels (loaded for the slice, scaled by the keys' per-channel statistics), so no code tile is
    reshaped or shuffled (each dot's reduction is ``WORDS``, at least 16). ``q . (c * s + z) = (q * s) . c + q . z``.
    ``PAIRS`` (float16 dots): shifts ``j`` and ``j + CPW / 2`` come out of one ``half_pairs``.
    """
    offs_w = tl.arange(0, WORDS)
    words = tl.load(k_ptr + rows[:, None] * WORDS + offs_w[None, :])  # [BLOCK_N, WORDS]
    base = (block * NUM_KV_HEADS + h) * HEAD_DIM
    s = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    q_zero = tl.zeros([BLOCK_G], tl.float32)
    if PAIRS and DOT_DTYPE == tl.float16:
        # Half-word u of a page row holds channels u * CPW / 2 + j (j < CPW / 2): a word's two codes at shift j are
        # half-words 2w and 2w + 1, adjacent in the dot's reduction, as a float16 MMA operand holds them.
        offs_u = tl.arange(0, 2 * WORDS)
        for j in tl.static_range(CPW // 2):
            low, high = half_pairs(words, j * BITS, BITS)
            k = tl.reshape(tl.join(low, high), [BLOCK_N, 2 * WORDS])
            s, q_zero = key_slice_dot(s, q_zero, k, j, q_row_ptr, heads, mask_g, stride_qh, scale_log2,
                                      k_scale_ptr, k_min_ptr, base, offs_u, CPW // 2, DOT_DTYPE, PRECISION,
                                      False)  # fmt: skip
        # the minima's term over every channel at once (one reduction a page, not one a slice)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_row_ptr + heads[None, :] * stride_qh + offs_d[:, None], mask=mask_g[None, :], other=0.0)
        first = tl.arange(0, 16)[:, None] == 0  # the minima as row 0 of a 16-row tile, the MMA's least
        zero = tl.load(k_min_ptr + base + offs_d[None, :] + 0 * first, mask=first, other=0.0)  # [16, HEAD_DIM]
        q_zero = tl.sum(tl.dot(zero.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=PRECISION), 0) * scale_log2
    else:
        for j in tl.static_range(CPW):
            codes = (words >> (j * BITS)) & ((1 << BITS) - 1)
            if DOT_DTYPE == tl.float16:
                k = code_half(codes)
            else:
                k = code_float(codes).to(DOT_DTYPE)
            s, q_zero = key_slice_dot(s, q_zero, k, j, q_row_ptr, heads, mask_g, stride_qh, scale_log2,
                                      k_scale_ptr, k_min_ptr, base, offs_w, CPW, DOT_DTYPE, PRECISION)  # fmt: skip
    return s + q_zero[None, :]


@triton.jit
def key_slice_dot(
    s, q_zero, k, j, q_row_ptr, heads, mask_g, stride_qh, scale_log2, k_scale_ptr, k_min_ptr, base, offs_w,
    CPW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ZERO: tl.constexpr = True,
):  # fmt: skip
    """One bit position ``j`` of ``kivi_key_slices``: its codes ``k`` ``[BLOCK_N, len(offs_w)]`` against the queries'
    rows of channels ``w * CPW + j`` (``w`` in ``offs_w``) scaled by the keys' statistics; ``(s, q_zero)`` updated
    (``q_zero`` only with ``ZERO``)."""
    chan = offs_w * CPW + j
    q = tl.load(q_row_ptr + heads[None, :] * stride_qh + chan[:, None], mask=mask_g[None, :], other=0.0)
    q = q.to(tl.float32) * scale_log2  # [WORDS, BLOCK_G]
    scale = tl.load(k_scale_ptr + base + chan).to(tl.float32)
    if ZERO:
        zero = tl.load(k_min_ptr + base + chan).to(tl.float32)
        q_zero += tl.sum(q * zero[:, None], 0)
    s = tl.dot(k, (q * scale[:, None]).to(DOT_DTYPE), acc=s, input_precision=PRECISION)
    return s, q_zero


@triton.jit
def kivi_key_page(
    q_scaled,
    k_ptr,
    k_scale_ptr,
    k_min_ptr,
    block,
    h,
    rows,
    offs_d,
    mask_d,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAPPED: tl.constexpr = False,
):
    """Scores ``q_scaled @ K`` ``[M, BLOCK_N]`` over one full KIVI page (``BLOCK_N`` = block size tokens).

    Per-channel statistics are loaded once per page and folded into the query:
    ``q . (c * s + z) = (q * s) . c + q . z``, so the codes enter the dot as exact small integers.
    ``SWAPPED``: ``q_scaled`` comes as ``[BLOCK_D, M]`` and the scores go out as ``K @ q`` ``[BLOCK_N, M]``
    (the page's tokens are the dot's rows, the query group its columns).
    """
    stat = (block * NUM_KV_HEADS + h) * HEAD_DIM + offs_d
    scale = tl.load(k_scale_ptr + stat, mask=mask_d, other=0.0).to(tl.float32)
    zero = tl.load(k_min_ptr + stat, mask=mask_d, other=0.0).to(tl.float32)
    mask_n = tl.full([BLOCK_N], 1, tl.int1)
    if SWAPPED:
        q_page = (q_scaled * scale[:, None]).to(DOT_DTYPE)
        q_zero = tl.sum(q_scaled * zero[:, None], 0)
        codes = value_codes(k_ptr, rows, offs_d, mask_n, mask_d, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS)
    else:
        q_page = (q_scaled * scale[None, :]).to(DOT_DTYPE)
        q_zero = tl.sum(q_scaled * zero[None, :], 1)
        codes = key_codes(k_ptr, rows, offs_d, mask_n, mask_d, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS)
    if DOT_DTYPE == tl.float16:
        k = code_half(codes)
    else:
        k = code_float(codes).to(DOT_DTYPE)
    if SWAPPED:
        s = tl.dot(k, q_page, input_precision=PRECISION) + q_zero[None, :]
    else:
        s = tl.dot(q_page, k, input_precision=PRECISION) + q_zero[:, None]
    return s


@triton.jit
def online_softmax(s, m_i, l_i, AXIS: tl.constexpr = 1):
    """One base-2 online-softmax step over scores ``s`` ``[M, N]`` (the keys along ``AXIS``, 1 or 0):
    ``(p, alpha, l_new, m_new)``."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    alpha = tl.exp2(m_i - m_new)
    if AXIS == 1:
        p = tl.exp2(s - m_new[:, None])
    else:
        p = tl.exp2(s - m_new[None, :])
    return p, alpha, l_i * alpha + tl.sum(p, AXIS), m_new
