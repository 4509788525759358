"""Triton ``cluster_select``: one program per (decode row, KV head), one launch.

Every column gets a rank value (``sparse_kernels.cluster_select.rank_values``, the reference's): an int32 below
``2 ** 23`` whose order is the rank's (the non-negative score's float32 bits without their 7 lowest, less the
group's offset, plus one; 0 for an empty column), from the logits and the merged tile statistics. The program
then finds, for both targets at once (``k1`` and ``k2``), the largest threshold that at least the target's count
of values reach, bit by bit from the top (23 steps, each one count of the values at or above two candidates),
places every column (a target's members: above its threshold, then the tied ones in column order; running
counts carried from tile to tile), and sorts the retrieved keys in registers.

A row's columns are held in registers, one tile of up to ``MAX_TILE`` (16384 columns: 256K tokens at 16-token
clusters); past that the values go through a scratch tensor and every step loops over the tiles. Session 29
replaced a radix select spread over (row, chunk) programs (two histogram rounds and a write pass with a
decoupled look-back: three launches, ~38 us a layer at batch 5 and 128K on the H200) by this: the work of a row
is small, so the launches' latency was the cost, not the parallelism.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit
from sparse_kernels.cluster_select import RANK_BITS, RANK_DROP, rank_offset

MAX_TILE = 16384  # columns a program holds at once
MAX_VALUE = (1 << RANK_BITS) - 1  # rank values are at most this
SHIFT = 24  # sort key of a retrieved column: (MAX_VALUE - rank value) << SHIFT | column, below 2 ** 47
PAD = 1 << 62


@triton.jit
def _normalizer(tmax_ptr, tsum_ptr, row, tiles, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per query head of the group: the row's logit maximum (0 where none is finite) and the sum of
    ``exp(logit - max)`` (1 where 0), merged from the logits kernel's tile statistics."""
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP
    top_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    for t0 in range(0, tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m2 = gm[:, None] & (t < tiles)[None, :]
        at = (row * GROUP + g)[:, None] * tiles + t[None, :]
        mt = tl.load(tmax_ptr + at, mask=m2, other=float("-inf"))
        st = tl.load(tsum_ptr + at, mask=m2, other=0.0)
        new = tl.maximum(top_m, tl.max(mt, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)
        total = total * tl.exp(top_m - safe) + tl.sum(st * tl.exp(mt - safe[:, None]), axis=1)
        top_m = new
    return tl.where(top_m == float("-inf"), 0.0, top_m), tl.where(total > 0, total, 1.0)


@triton.jit
def _tile_values(
    logit_ptr, size_ptr, row, col, cm, columns, safe, total,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, DROP: tl.constexpr, OFFSET: tl.constexpr, MAX_VALUE: tl.constexpr,
):  # fmt: skip
    """The rank values of columns ``col`` (as ``rank_values``); -1 past the row (below every threshold)."""
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP
    size = tl.load(size_ptr + row * columns + col, mask=cm, other=0)
    lg = tl.load(
        logit_ptr + (row * GROUP + g)[:, None] * columns + col[None, :], mask=gm[:, None] & cm[None, :],
        other=float("-inf"),
    )  # fmt: skip
    live = cm & (size > 0)
    keep = gm[:, None] & live[None, :]
    p = tl.sum(tl.where(keep, tl.exp(lg - safe[:, None]) / total[:, None], 0.0), axis=0) + 0.0
    truncated = (p.to(tl.int32, bitcast=True) >> DROP) - OFFSET
    value = tl.where(live, tl.minimum(tl.maximum(truncated, 0), MAX_VALUE - 1) + 1, 0)
    return tl.where(cm, value, -1)


@triton.jit
def _at_least(value_ptr, row, v, t, columns, TILE: tl.constexpr, ONE_TILE: tl.constexpr):
    """``[2]`` how many of the row's values are at least ``t[0]`` and ``t[1]``."""
    if ONE_TILE:
        n = tl.sum((v[:, None] >= t[None, :]).to(tl.int32), axis=0)
    else:
        n = tl.zeros([2], tl.int32)
        for c0 in range(0, columns, TILE):
            col = c0 + tl.arange(0, TILE)
            w = tl.load(value_ptr + row * columns + col, mask=col < columns, other=-1, cache_modifier=".cg")
            n += tl.sum((w[:, None] >= t[None, :]).to(tl.int32), axis=0)
    return n


@triton.jit
def _pick(vector, i):
    return tl.sum(tl.where(tl.arange(0, 2) == i, vector, 0), axis=0)


def _cluster_select_kernel(
    logit_ptr, size_ptr, tmax_ptr, tsum_ptr, ret_ptr, est_ptr, value_ptr, out_ptr, columns, tiles, heads,
    read_width, est_width,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, TILE: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_R: tl.constexpr, DROP: tl.constexpr, OFFSET: tl.constexpr, MAX_VALUE: tl.constexpr, BITS: tl.constexpr,
    SHIFT: tl.constexpr, PAD: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    row = tl.program_id(0).to(tl.int64)  # (decode row, KV head)
    b = row // heads
    k1 = tl.minimum(tl.maximum(tl.load(ret_ptr + b), 0), tl.minimum(read_width, columns)).to(tl.int32)
    k2 = tl.minimum(k1 + tl.minimum(tl.maximum(tl.load(est_ptr + b), 0), est_width), columns).to(tl.int32)
    safe, total = _normalizer(tmax_ptr, tsum_ptr, row, tiles, GROUP, BLOCK_G, BLOCK_T)
    col = tl.arange(0, TILE)
    if ONE_TILE:
        v = _tile_values(logit_ptr, size_ptr, row, col, col < columns, columns, safe, total,
                         GROUP, BLOCK_G, DROP, OFFSET, MAX_VALUE)  # fmt: skip
    else:
        v = tl.zeros([TILE], tl.int32)
        for c0 in range(0, columns, TILE):
            cm = c0 + col < columns
            w = _tile_values(logit_ptr, size_ptr, row, c0 + col, cm, columns, safe, total,
                             GROUP, BLOCK_G, DROP, OFFSET, MAX_VALUE)  # fmt: skip
            tl.store(value_ptr + row * columns + c0 + col, w, mask=cm)
        tl.debug_barrier()  # the values are stored before any thread counts them
    # Per target the largest threshold at least k of the values reach (k = 0: the top value, which none passes),
    # bit by bit from the top; then how many lie above it.
    j = tl.arange(0, 2)
    k = tl.where(j == 0, k1, k2)
    lo = tl.zeros([2], tl.int32)
    for i in tl.static_range(BITS):
        t = lo + (1 << (BITS - 1 - i))
        lo = tl.where(_at_least(value_ptr, row, v, t, columns, TILE, ONE_TILE) >= k, t, lo)
    above = _at_least(value_ptr, row, v, lo + 1, columns, TILE, ONE_TILE)
    p1, p2 = _pick(lo, 0), _pick(lo, 1)
    s1, s2 = k1 - _pick(above, 0), k2 - _pick(above, 1)  # tied values each target takes, in column order
    # Place every column: the retrieved as sort keys at [0, k1), the estimated at [k1, k2), the rest after.
    tie1 = tl.sum(tl.zeros([2], tl.int32), axis=0)
    tie2 = tie1
    n_r = tie1
    n_e = tie1
    n_o = tie1
    for c0 in range(0, columns, TILE):
        c = c0 + col
        cm = c < columns
        if not ONE_TILE:
            v = tl.load(value_ptr + row * columns + c, mask=cm, other=-1, cache_modifier=".cg")
        eq1 = (cm & (v == p1)).to(tl.int32)
        eq2 = (cm & (v == p2)).to(tl.int32)
        in1 = cm & ((v > p1) | ((eq1 > 0) & (tie1 + tl.cumsum(eq1, axis=0) - eq1 < s1)))
        in2 = cm & ((v > p2) | ((eq2 > 0) & (tie2 + tl.cumsum(eq2, axis=0) - eq2 < s2)))
        r = in1.to(tl.int32)
        e = (in2 & ~in1).to(tl.int32)
        o = (cm & ~in2).to(tl.int32)
        at1 = n_r + tl.cumsum(r, axis=0) - r
        at2 = k1 + n_e + tl.cumsum(e, axis=0) - e
        at3 = k2 + n_o + tl.cumsum(o, axis=0) - o
        key = ((MAX_VALUE - v).to(tl.int64) << SHIFT) | c.to(tl.int64)
        tl.store(out_ptr + row * columns + at1, key, mask=in1)
        tl.store(out_ptr + row * columns + tl.where(e > 0, at2, at3), c.to(tl.int64), mask=cm & ~in1)
        tie1 += tl.sum(eq1, axis=0)
        tie2 += tl.sum(eq2, axis=0)
        n_r += tl.sum(r, axis=0)
        n_e += tl.sum(e, axis=0)
        n_o += tl.sum(o, axis=0)
    tl.debug_barrier()  # every retrieved key is in place: sort them
    i = tl.arange(0, BLOCK_R)
    keys = tl.sort(tl.load(out_ptr + row * columns + i, mask=i < k1, other=PAD, cache_modifier=".cg"))
    tl.store(out_ptr + row * columns + i, keys & ((1 << SHIFT) - 1), mask=i < k1)
    pdl_exit(USE_GDC)


cluster_select_kernel = Kernel(_cluster_select_kernel)


def cluster_select_triton(logits, sizes, tile_max, tile_sum, retrieved, estimated, read_width: int, est_width: int):
    n, heads, group, columns = logits.shape
    if columns >= 1 << SHIFT:
        raise ValueError(f"at most {(1 << SHIFT) - 1} cluster columns, got {columns}")
    rows, tiles = n * heads, tile_max.shape[-1]
    device = logits.device
    tile = min(MAX_TILE, max(16, triton.next_power_of_2(columns)))
    one_tile = columns <= tile
    out = torch.empty(n, heads, columns, dtype=torch.int64, device=device)
    values = out if one_tile else torch.empty(rows, columns, dtype=torch.int32, device=device)  # unused if one tile
    counts = (retrieved.to(torch.int64).contiguous(), estimated.to(torch.int64).contiguous())
    logits, sizes = logits.contiguous(), sizes.to(torch.int32).contiguous()
    cluster_select_kernel[(rows,)](
        logits, sizes, tile_max.contiguous(), tile_sum.contiguous(), *counts, values, out, columns, tiles, heads,
        read_width, est_width,
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_T=min(64, triton.next_power_of_2(tiles)), TILE=tile,
        ONE_TILE=one_tile, BLOCK_R=max(16, triton.next_power_of_2(min(read_width, columns))), DROP=RANK_DROP,
        OFFSET=rank_offset(group), MAX_VALUE=MAX_VALUE, BITS=RANK_BITS, SHIFT=SHIFT, PAD=PAD,
        num_warps=max(4, min(32, tile // 512)), **pdl_args(device),
    )  # fmt: skip
    return out
