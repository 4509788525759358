"""Triton ``top_k_ascending``: one program per row (or per row tile) finds the k-th largest from the
values' ordered bit patterns, then writes the chosen columns through a prefix sum.

Two selects (``CONFIG["select"]``):

- ``serial``: the k-th largest bit by bit, one block-wide count per bit (32 passes).
- ``packed``: ``bits`` bits per pass. A pass counts the entries of the current interval
  ``[t, t + 2**(shift + bits))`` by their digit ``(key - t) >> shift``, every digit's count in one
  reduction (16-bit fields, four to a 64-bit word, all words reduced together), and keeps the
  largest digit whose entries, with all those above it, reach k. ``32 / bits`` passes, each still
  one reduction's latency; the price is a few more instructions per entry and pass. Also: one scan
  instead of two for the output places, and programmatic dependent launch.

bfloat16 rows take ``KEY_BITS`` 16: a bfloat16 value's float32 key has a constant low half, so the
passes cover the high 16 bits only (half the passes of float32 rows).

Rows wider than ``CONFIG["single"]`` go through candidate stages first: each tile of ``tile``
columns keeps its own ``k`` best (values and columns, in column order), until one program per row
picks the ``k`` best of the last candidates; small tiles spread a row over many SMs. Exact, ties
included: an entry its tile drops has ``k`` entries of its tile that rank before it (larger, or equal
and earlier), so the whole row drops it too; and candidates stay in column order, so ties still go
to the earlier column."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

MAX_COLUMNS = 32768  # one program holds its row (or its candidates) in registers; ranks fit 16 bits

# How rows are split and selected (benchmarks/quest_select_probe.py times the variants side by side).
# select: "serial" or "packed"; bits: key bits per packed pass (1-4); fused: a packed pass's digit
# counts in one reduction (else one per 64-bit word); single: rows up to this wide take one program;
# merge: candidates up to this wide (or the tile) take the row's last program, wider ones another
# stage; tile, tile_per_k: columns per program of a candidate stage, at least tile_per_k * k (and
# 2 k), a power of two; columns_per_warp, min_warps: a program's warps, its width / columns_per_warp
# in [min_warps, 32].
# The default is the fastest variant measured on the H200 (session 8, results/bench/h200/session8/topk/:
# Quest's [40, 8448] k=128 rows 16.0 us against the serial kernel's 31.5; OmniKV's [5, 135168] k=2048
# 74.8 us against 114.9): packed 2-bit passes, rows over 2048 columns split into 4096-column tiles.
CONFIG = {
    "select": "packed",
    "bits": 2,
    "fused": True,
    "single": 2048,
    "merge": MAX_COLUMNS,
    "tile": 4096,
    "tile_per_k": 4,
    "columns_per_warp": 512,
    "min_warps": 4,
}


@triton.jit
def _ordered_keys(x, valid):
    """uint32 keys whose unsigned order is the floats' order (``-0.0`` as ``0.0``); 0, below every
    float's key but NaN's, off the row."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits)
    key = tl.where(x == 0.0, -2147483648, key)
    return tl.where(valid, key, 0).to(tl.uint32, bitcast=True)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _digit_counts(digit, BITS: tl.constexpr, FUSED: tl.constexpr):
    """Per 64-bit word ``w`` (a tuple of scalars): the entries of digit ``4w + f`` in its 16-bit field
    ``f``; digits of ``2**BITS`` and more are not counted. ``BITS`` 2-4. ``FUSED``: one reduction of
    all the words (its barriers shared), else one per word (also what the interpreter runs fast: it
    combines a custom reduction element by element in Python)."""
    quarter = digit >> 2
    one = tl.full(digit.shape, 1, tl.uint64) << ((digit & 3) << 4).to(tl.uint64)
    words = ()
    sums = ()
    for w in tl.static_range(2 ** (BITS - 2)):
        word = tl.where(quarter == w, one, 0)
        words = words + (word,)
        if not FUSED:
            sums = sums + (tl.sum(word, axis=0),)
    if FUSED:
        if BITS == 2:
            sums = (tl.sum(words[0], axis=0),)
        elif BITS == 3:
            sums = tl.reduce(words, 0, _add2)
        else:
            sums = tl.reduce(words, 0, _add4)
    return sums


@triton.jit
def _kth_largest(key, kk, BITS: tl.constexpr, FUSED: tl.constexpr, KEY_BITS: tl.constexpr):
    """``(t, above)``: the ``kk``-th largest of ``key`` (uint32 below ``2**KEY_BITS``) and how many keys
    exceed it, ``BITS`` bits of ``t`` per pass from the top (the top pass takes the remainder when
    ``BITS`` does not divide ``KEY_BITS``)."""
    FIRST: tl.constexpr = KEY_BITS - BITS * ((KEY_BITS + BITS - 1) // BITS - 1)
    t = kk.to(tl.uint32) * 0
    above = kk * 0
    for i in tl.static_range((KEY_BITS + BITS - 1) // BITS):
        t, above = _select_digit(key, t, above, kk, KEY_BITS - FIRST - BITS * i, BITS, FUSED)
    return t, above


@triton.jit
def _select_digit(key, t, above, kk, SHIFT: tl.constexpr, BITS: tl.constexpr, FUSED: tl.constexpr):
    """One pass: the bits of ``t`` from ``SHIFT`` up to the previous pass's.

    Invariant: ``t``'s bits below the previous pass's are 0; at least ``kk`` keys are ``>= t``; the
    ``above`` keys at or past the interval's end (``t`` plus one at the previous pass's bit) are
    fewer than ``kk``. A key below ``t`` wraps around in ``key - t`` to at least the interval's size,
    so its digit, like those of keys past the interval, is ``2**BITS`` or more: never counted. The
    new digit is how many digits ``d >= 1`` have ``count(key >= t + d << SHIFT) >= kk`` (the counts
    fall with ``d``), the new ``above`` the largest of the other counts: all compared at once."""
    digit = (key - t) >> SHIFT
    if BITS == 1:  # one count
        count = above + tl.sum((digit == 1).to(tl.int32), axis=0)
        t = tl.where(count >= kk, t + (1 << SHIFT), t)
        above = tl.where(count >= kk, above, count)
    else:
        counts = _digit_counts(digit, BITS, FUSED)
        higher = above  # keys past the current word's digits
        sel = kk * 0
        new_above = above
        for i in tl.static_range(len(counts)):
            word = counts[len(counts) - 1 - i]
            suffix = word + (word >> 16) + (word >> 32) + (word >> 48)  # field f: the word's digits 4w + f and up
            for f in tl.static_range(4):
                if 4 * (len(counts) - 1 - i) + f >= 1:
                    count = higher + ((suffix >> (16 * f)) & 0xFFFF).to(tl.int32)
                    sel += (count >= kk).to(tl.int32)
                    new_above = tl.maximum(new_above, tl.where(count < kk, count, 0))
            higher += (suffix & 0xFFFF).to(tl.int32)
        t = t + (sel.to(tl.uint32) << SHIFT)
        above = new_above
    return t, above


@triton.jit
def _load_tile(x_ptr, stride_x, n, k, tile, BLOCK: tl.constexpr):
    """Program ``(row, tile)``'s columns: ``(row, col0, kk, offs, valid, x)``, ``kk`` the entries it keeps."""
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * tile
    width = tl.minimum(tile, n - col0)
    offs = tl.arange(0, BLOCK)
    valid = offs < width
    x = tl.load(x_ptr + row * stride_x + col0 + offs, mask=valid, other=0.0)
    return row, col0, tl.minimum(k, width), offs, valid, x


@triton.jit
def _store_chosen(x, chosen, pos, offs, row, col0, kk, k, idx_ptr, out_ptr, val_ptr, stride_x, stride_out,
                  BLOCK: tl.constexpr, GATHER: tl.constexpr, WRITE_VALUES: tl.constexpr):  # fmt: skip
    """Chosen entry ``i`` (of the tile starting at ``col0``) to place ``pos[i]`` of the program's output."""
    base = row * stride_out + tl.program_id(1).to(tl.int64) * k
    if GATHER:  # the candidates' own columns
        cols = tl.load(idx_ptr + row * stride_x + col0 + offs, mask=chosen, other=0)
    else:
        cols = (col0 + offs).to(tl.int64)
    tl.store(out_ptr + base + pos, cols, mask=chosen)
    if WRITE_VALUES:  # candidate stage: values too, a short tile's unused places as -inf (never chosen)
        tl.store(val_ptr + base + pos, x, mask=chosen)
        pad = (offs >= kk) & (offs < k)
        tl.store(val_ptr + base + offs, tl.full([BLOCK], float("-inf"), val_ptr.dtype.element_ty), mask=pad)
        tl.store(out_ptr + base + offs, tl.zeros([BLOCK], tl.int64), mask=pad)


def _serial_kernel(
    x_ptr,
    idx_ptr,
    out_ptr,
    val_ptr,
    stride_x,
    n,
    k,
    tile,
    stride_out,
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
):
    row, col0, kk, offs, valid, x = _load_tile(x_ptr, stride_x, n, k, tile, BLOCK)
    xf = x.to(tl.float32)  # bfloat16 rows: exact
    bits = xf.to(tl.int32, bitcast=True)
    # Ordered keys: non-negative floats keep their bits, negative ones flip the magnitude bits, so
    # integer order is float order; -0.0 maps to 0.0's key.
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(xf == 0.0, 0, key)
    # The largest t with count(key >= t) >= kk is the kk-th largest key: its sign first, then its other
    # 31 bits from the top (within one sign, int32 order is the order of those bits). int32 only.
    nonneg = tl.sum(((key >= 0) & valid).to(tl.int32), axis=0)
    t = tl.where(nonneg >= kk, 0, -2147483648)
    for i in range(31):
        cand = t | (1 << (30 - i))
        count = tl.sum(((key >= cand) & valid).to(tl.int32), axis=0)
        t = tl.where(count >= kk, cand, t)
    above = (key > t) & valid
    at = (key == t) & valid
    need = kk - tl.sum(above.to(tl.int32), axis=0)
    chosen = above | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    _store_chosen(x, chosen, pos, offs, row, col0, kk, k, idx_ptr, out_ptr, val_ptr, stride_x, stride_out,
                  BLOCK, GATHER, WRITE_VALUES)  # fmt: skip


def _packed_kernel(
    x_ptr,
    idx_ptr,
    out_ptr,
    val_ptr,
    stride_x,
    n,
    k,
    tile,
    stride_out,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    FUSED: tl.constexpr,
    GATHER: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
    KEY_BITS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the scores are the step's previous kernel's output
    row, col0, kk, offs, valid, x = _load_tile(x_ptr, stride_x, n, k, tile, BLOCK)
    key = _ordered_keys(x.to(tl.float32), valid)
    if KEY_BITS == 16:  # bfloat16 scores: the float32 key's low half is 0 (or all ones, negated): drop it
        key = key >> 16
    t, above = _kth_largest(key, kk, BITS, FUSED, KEY_BITS)
    # Every key above t is taken, and the first kk - above equal to it: both ranks from one scan, the
    # ties' in the low 16 bits (at most 32768), the larger keys' above them (fewer than kk).
    larger = key > t
    tied = key == t
    ranks = tl.cumsum(tied.to(tl.int32) + (larger.to(tl.int32) << 16), axis=0)
    need = kk - above
    chosen = larger | (tied & ((ranks & 0xFFFF) <= need))
    pos = (ranks >> 16) + tl.minimum(ranks & 0xFFFF, need) - 1
    _store_chosen(x, chosen, pos, offs, row, col0, kk, k, idx_ptr, out_ptr, val_ptr, stride_x, stride_out,
                  BLOCK, GATHER, WRITE_VALUES)  # fmt: skip
    pdl_exit(USE_GDC)


serial_kernel = Kernel(_serial_kernel)
packed_kernel = Kernel(_packed_kernel)


def _launch(x, idx, out, values, n: int, k: int, tile: int, stride_out: int, tiles: int) -> None:
    block = max(16, triton.next_power_of_2(tile))
    num_warps = max(CONFIG["min_warps"], min(32, block // CONFIG["columns_per_warp"]))
    args = (x, x if idx is None else idx, out, out if values is None else values, x.stride(0), n, k, tile, stride_out)
    meta = dict(BLOCK=block, GATHER=idx is not None, WRITE_VALUES=values is not None, num_warps=num_warps)
    if CONFIG["select"] == "serial":
        serial_kernel[(x.shape[0], tiles)](*args, **meta)
    else:
        key_bits = 16 if x.dtype == torch.bfloat16 else 32
        meta.update(BITS=CONFIG["bits"], FUSED=CONFIG["fused"], KEY_BITS=key_bits, **pdl_args(x.device))
        packed_kernel[(x.shape[0], tiles)](*args, **meta)


def stages(n: int, k: int) -> list[int] | None:
    """Tile widths of the candidate stages a row of ``n`` goes through before its last program (``[]``:
    one program; ``None``: the kernel does not take it). A stage's tile is ``CONFIG["tile"]``, raised
    to a power of two of at least ``tile_per_k * k`` (only ``2 k`` where that would not fit one
    program) and ``2 k``, so that a stage leaves at most half its input (plus one short tile). Rows
    wider than ``single`` take a stage, candidates wider than ``merge`` and the tile another."""
    if n <= min(CONFIG["single"], MAX_COLUMNS):
        return []
    tile = max(CONFIG["tile"], triton.next_power_of_2(max(2, CONFIG["tile_per_k"]) * k))
    if tile > MAX_COLUMNS:  # a wide k: the smallest tile that still halves its input
        tile = max(CONFIG["tile"], triton.next_power_of_2(2 * k))
    if tile > MAX_COLUMNS or n <= tile:  # a stage would keep most (all) of its input
        return [] if n <= MAX_COLUMNS else None
    tiles, width = [tile], triton.cdiv(n, tile) * k
    while width > max(min(CONFIG["merge"], MAX_COLUMNS), tile):
        tiles.append(tile)
        width = triton.cdiv(width, tile) * k
    return tiles


def fits(n: int, k: int) -> bool:
    """Whether the kernel takes rows of ``n`` columns."""
    return stages(n, k) is not None


def top_k_ascending_triton(scores: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """``scores`` [R, N], ``out`` [R, k] contiguous int64; validated by the caller, ``fits(N, k)``."""
    rows, n = scores.shape
    values, columns, width = scores, None, n
    if values.stride(1) != 1:
        values = values.contiguous()
    for tile in stages(n, k):  # each tile's k best (values and columns, in column order)
        tiles = triton.cdiv(width, tile)
        kept = torch.empty(rows, tiles * k, dtype=torch.int64, device=scores.device)
        kept_values = torch.empty(rows, tiles * k, dtype=scores.dtype, device=scores.device)
        _launch(values, columns, kept, kept_values, width, k, tile, tiles * k, tiles)
        values, columns, width = kept_values, kept, tiles * k
    _launch(values, columns, out, None, width, k, width, k, 1)
    return out
