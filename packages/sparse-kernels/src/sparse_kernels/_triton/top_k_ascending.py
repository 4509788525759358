"""Triton ``top_k_ascending``: one program per row (or per row tile) finds the k-th largest by a radix
select, then writes the chosen columns through a prefix sum.

The select: values become order-preserving int32 keys; four passes, one per byte from the top, each
take a 256-bin histogram of the byte over the entries still tied with the k-th (``tl.histogram``),
keep every entry of a larger byte, and narrow the tie to the byte that holds the k-th. After the four
passes the tied entries all equal the k-th largest, and the first ``need`` of them in column order are
taken (ties to the lower column). Four passes, where a bit-by-bit search takes 32.

A histogram pass costs a few instructions per entry on the SM that runs it (warp ballots or shared
memory atomics, by Triton version), so rows wider than ``SINGLE`` are spread over many programs
through candidate stages first: each tile of a stage keeps its own ``k`` best (values and columns, in
column order), until one program per row picks the ``k`` best of the last candidates. Exact, ties
included: an entry its tile drops has ``k`` entries of its tile that rank before it (larger, or equal
and earlier), so the whole row drops it too; and candidates stay in column order, so ties still go to
the earlier column."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

SINGLE = 2048  # a row (or a stage's candidates) this narrow is one program's
MIN_TILE = 1024  # columns per program of a candidate stage: at least this, and 4 k
TILE = 16384  # (at most)
MAX_COLUMNS = 32768  # widest row one program takes when k is too large for stages
ELEMENTS_PER_WARP = 1024  # warps of a program = its width / this, in [4, 32]


def _top_k_ascending_kernel(
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
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the scores are the step's previous kernel's output
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * tile
    width = tl.minimum(tile, n - col0)
    kk = tl.minimum(k, width)
    offs = tl.arange(0, BLOCK)
    valid = offs < width
    x = tl.load(x_ptr + row * stride_x + col0 + offs, mask=valid, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    # Ordered keys: non-negative floats keep their bits, negative ones flip the magnitude bits, so
    # integer order is float order; -0.0 maps to 0.0's key.
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    bins = tl.arange(0, 256)
    t = 0  # the k-th largest key, one byte per pass from the top (the others 0)
    need = kk  # how many entries equal to the k-th largest to take
    for i in tl.static_range(4):
        if i == 0:
            tied = valid
            digit = ((key >> (24 - 8 * i)) & 0xFF) ^ 0x80  # the sign byte: negative keys below non-negative ones
        else:
            tied = valid & (((key ^ t) >> (32 - 8 * i)) == 0)  # the bytes above this one equal t's
            digit = (key >> (24 - 8 * i)) & 0xFF
        hist = tl.histogram(digit, 256, mask=tied)  # [256]
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # tied entries with byte >= bin
        sel = tl.max(tl.where(at_least >= need, bins, -1), axis=0)  # the k-th largest's byte
        need -= tl.sum(tl.where(bins > sel, hist, 0), axis=0)
        if i == 0:
            t = (sel ^ 0x80) << 24
        else:
            t = t | (sel << (24 - 8 * i))
    at = (key == t) & valid
    chosen = ((key > t) & valid) | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    base = row * stride_out + tl.program_id(1).to(tl.int64) * k
    if GATHER:  # the candidates' own columns
        cols = tl.load(idx_ptr + row * stride_x + col0 + offs, mask=chosen, other=0)
    else:
        cols = (col0 + offs).to(tl.int64)
    tl.store(out_ptr + base + pos, cols, mask=chosen)
    if WRITE_VALUES:  # first stage: candidates' values, a short tile's unused places as -inf (never chosen)
        tl.store(val_ptr + base + pos, x, mask=chosen)
        pad = (offs >= kk) & (offs < k)
        tl.store(val_ptr + base + offs, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)
        tl.store(out_ptr + base + offs, tl.zeros([BLOCK], tl.int64), mask=pad)
    pdl_exit(USE_GDC)


top_k_ascending_kernel = Kernel(_top_k_ascending_kernel)


def _launch(x, idx, out, values, n: int, k: int, tile: int, stride_out: int, tiles: int) -> None:
    block = max(16, triton.next_power_of_2(tile))
    top_k_ascending_kernel[(x.shape[0], tiles)](
        x,
        x if idx is None else idx,
        out,
        out if values is None else values,
        x.stride(0),
        n,
        k,
        tile,
        stride_out,
        BLOCK=block,
        GATHER=idx is not None,
        WRITE_VALUES=values is not None,
        num_warps=max(4, min(32, block // ELEMENTS_PER_WARP)),
        **pdl_args(x.device),
    )


def stages(n: int, k: int) -> list[int] | None:
    """Tile widths of the candidate stages a row of ``n`` goes through before its final program (``[]``:
    one program; ``None``: the kernel does not take it, see ``fits``). Each tile is the smallest power
    of two of at least ``4 k`` and ``MIN_TILE`` (at most ``TILE``, and at least ``2 k``), so a stage
    leaves at most a quarter (half) of its input, plus one short tile; stages run until one program
    takes the rest."""
    if n <= SINGLE:
        return []
    tile = min(max(MIN_TILE, triton.next_power_of_2(4 * k)), TILE)
    if tile < 2 * k:  # a stage would keep most of its input
        return [] if n <= MAX_COLUMNS else None
    tiles, width = [], n
    while width > max(SINGLE, tile):
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
        kept_values = torch.empty(rows, tiles * k, dtype=torch.float32, device=scores.device)
        _launch(values, columns, kept, kept_values, width, k, tile, tiles * k, tiles)
        values, columns, width = kept_values, kept, tiles * k
    _launch(values, columns, out, None, width, k, width, k, 1)
    return out
