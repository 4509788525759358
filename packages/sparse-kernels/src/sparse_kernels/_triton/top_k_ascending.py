"""Triton ``top_k_ascending``: one program per row (or per row tile); the k-th largest bit by bit, then a
prefix sum. Rows wider than a program holds go in two stages: each tile of ``TILE`` columns keeps its
own ``k`` best (values and columns, in column order), then one program per row picks the ``k`` best
of those candidates. Exact, ties included: an entry its tile drops has ``k`` entries of its tile that
rank before it (larger, or equal and earlier), so the whole row drops it too; and candidates stay in
column order, so ties still go to the earlier column."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel

MAX_COLUMNS = 32768  # one program holds its row (or its candidates) in registers
TILE = 16384  # columns per first-stage program of a wider row


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
):
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
        num_warps=max(4, min(32, block // 1024)),
    )


def fits(n: int, k: int) -> bool:
    """Whether the kernel takes rows of ``n`` columns (one stage, or two)."""
    return n <= MAX_COLUMNS or (k <= TILE and triton.cdiv(n, TILE) * k <= MAX_COLUMNS)


def top_k_ascending_triton(scores: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """``scores`` [R, N], ``out`` [R, k] contiguous int64; validated by the caller, ``fits(N, k)``."""
    rows, n = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if n <= MAX_COLUMNS:
        _launch(scores, None, out, None, n, k, n, k, 1)
        return out
    tiles = triton.cdiv(n, TILE)
    width = tiles * k
    columns = torch.empty(rows, width, dtype=torch.int64, device=scores.device)
    values = torch.empty(rows, width, dtype=torch.float32, device=scores.device)
    _launch(scores, None, columns, values, n, k, TILE, width, tiles)
    _launch(values, columns, out, None, width, k, width, k, 1)
    return out
