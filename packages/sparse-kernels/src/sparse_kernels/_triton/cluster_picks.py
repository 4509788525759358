"""Triton ``cluster_picks``, in one launch (``ONE_LAUNCH``, the default) or two.

Two launches: the running sums of the ordered clusters' sizes (tile by tile until they pass the row's budget),
the read count and the estimated ids in one program per (row, KV head); then the slots in one program per
(row, KV head, tile of slots), each picked token's cluster found by a binary search over the running sums written
(searchsorted, right side).

One launch (``_cluster_picks_kernel``): one program per (row, KV head, tile), each recomputing its row's running
sums (``top`` is small: one tile of ``BLOCK`` at the engine's shape), writing them to a scratch row shared by the
row's programs, then searching them for its tile of slots and writing its tile of the estimated ids. Two small
latency-bound launches a layer become one.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

BLOCK = 1024  # ranked clusters per tile of the running sum
BLOCK_E = 512  # estimated ids per tile
BLOCK_W = 256  # slots per program
# One kernel (``_cluster_picks_kernel``, the default), or the running sums' kernel then the slots' (the session 21
# pair, kept for A/B runs; ``SPARSE_KERNELS_PICKS_ONE_LAUNCH=0`` turns it on; tests hold both to the torch reference).
# On the H200 at batch 5 / 128K the one launch took 0.440 ms a step against the pair's 0.277 + 0.271 ms and the
# engine 8.82 ms a step against 8.92 (results/bench/h200/session33/c1/).
ONE_LAUNCH = os.environ.get("SPARSE_KERNELS_PICKS_ONE_LAUNCH", "1").strip() != "0"
# Session 21 tried, on the H200 at batch 5 / 128K: every id in one tile of 2048 (runs 0.274 -> 0.292 ms a step)
# and, instead of the binary search, counting the running sums at or below each place in tiles of 128 among the
# places read, 64 slots a program (slots 0.283 -> 3.25 ms a step: far more compares than the search's loads
# cost). Neither kept (results/bench/h200/session21/retro_c2/).


@triton.jit
def _running_sums(order_ptr, sizes_ptr, cum_ptr, row, order_stride, top, columns, budget, BLOCK: tl.constexpr):
    """The row's running sums of its ordered clusters' sizes, stored to ``cum``, tile by tile until they pass the
    budget (past it no cluster is read: the rest is never searched); ``(carry, read, covered)``: the sum so far, the
    places read (running start below the budget, empty ones too) and the places stored."""
    carry = tl.sum(tl.zeros([BLOCK], tl.int64), axis=0)
    read = tl.sum(tl.zeros([BLOCK], tl.int64), axis=0)
    start = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    while (start < top) & (carry < budget):
        t = start + tl.arange(0, BLOCK)
        m = t < top
        o = tl.load(order_ptr + row * order_stride + t, mask=m, other=0)
        s = tl.load(sizes_ptr + row * columns + o, mask=m, other=0).to(tl.int64)
        c = tl.cumsum(s, axis=0) + carry
        tl.store(cum_ptr + row * top + t, c, mask=m)
        read += tl.sum((((c - s) < budget) & m).to(tl.int64), axis=0)
        carry += tl.sum(s, axis=0)
        start += BLOCK
    return carry, read, tl.minimum(start, top)


@triton.jit
def _estimated_ids(
    order_ptr, plan_ptr, ids_ptr, r, row, plan_stride, order_stride, top, est, read, first, step,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    """The row's estimated ids (the ordered columns from ``read`` up to its retrieved plus estimated, as arena
    columns; -1 past them), in the tiles of ``BLOCK_E`` from ``first`` every ``step`` entries."""
    clu_base = tl.load(plan_ptr + plan_stride + r)
    ranked = tl.load(plan_ptr + 5 * plan_stride + r) + tl.load(plan_ptr + 6 * plan_stride + r)
    wanted = tl.minimum(ranked, tl.load(plan_ptr + 2 * plan_stride + r)) - read
    for e0 in range(first, est, step):
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < est
        rank = read + e
        o = tl.load(order_ptr + row * order_stride + tl.minimum(rank, top - 1), mask=em, other=0)
        tl.store(ids_ptr + row * est + e, tl.where((e < wanted) & (rank < top), clu_base + o, -1), mask=em)


@triton.jit
def _slots(
    order_ptr, sizes_ptr, offsets_ptr, positions_ptr, plan_ptr, kv_ptr, cum_ptr, slots_ptr, r, h, row, tile,
    plan_stride, order_stride, top, columns, total_clusters, total_positions, width, sink, steps, num_picked,
    covered, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """The row's tile ``tile`` of ``BLOCK_W`` slots: the sink, then each picked place's token (its cluster the
    first running sum above the place, by a binary search over ``cum`` below ``covered``), then the unindexed
    tail, then the newest position."""
    i = (tile * BLOCK_W + tl.arange(0, BLOCK_W)).to(tl.int64)
    im = i < width
    kv = tl.load(kv_ptr + r)
    tok_base = tl.load(plan_ptr + r)
    clu_base = tl.load(plan_ptr + plan_stride + r)
    end = tl.load(plan_ptr + 3 * plan_stride + r)
    num_sink = tl.minimum(tl.maximum(kv, 0), sink)
    tail_lo = tl.maximum(end, num_sink)
    num_tail = tl.maximum(kv - tail_lo, 0)
    newest = tl.maximum(kv - 1, 0)
    k = i - num_sink
    inside = (k >= 0) & (k < num_picked) & im
    j = tl.where(inside, k, 0)
    lo = tl.zeros([BLOCK_W], tl.int64)
    hi = tl.zeros([BLOCK_W], tl.int64) + covered
    for _ in range(steps):  # the first running sum above j
        active = lo < hi
        mid = (lo + hi) // 2
        c = tl.load(cum_ptr + row * top + tl.minimum(mid, top - 1), mask=inside & active, other=0)
        go = c <= j
        lo = tl.where(active & go, mid + 1, lo)
        hi = tl.where(active & ~go, mid, hi)
    rank = tl.minimum(lo, top - 1)
    o = tl.load(order_ptr + row * order_stride + rank, mask=inside, other=0)
    c = tl.load(cum_ptr + row * top + rank, mask=inside, other=0)
    s = tl.load(sizes_ptr + row * columns + o, mask=inside, other=0).to(tl.int64)
    cid = tl.minimum(clu_base + o, total_clusters - 1)
    first = tl.load(offsets_ptr + h * total_clusters + cid, mask=inside, other=0).to(tl.int64)
    slot = tl.minimum(tl.maximum(tok_base + first + j - (c - s), 0), total_positions - 1)
    pos = tl.load(positions_ptr + h * total_positions + slot, mask=inside, other=0).to(tl.int64)
    out = tl.where(k - num_picked < num_tail, tail_lo + k - num_picked, newest)
    out = tl.where(k < num_picked, pos, out)
    out = tl.where(k < 0, i, out)
    tl.store(slots_ptr + row * width + i, out, mask=im)


def _cluster_runs_kernel(
    order_ptr, sizes_ptr, plan_ptr, cum_ptr, picked_ptr, covered_ptr, ids_ptr, plan_stride, order_stride, top,
    columns, reach, est,
    HEADS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, ESTIMATE: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = r * HEADS + h
    budget = tl.load(plan_ptr + 4 * plan_stride + r)
    carry, read, covered = _running_sums(order_ptr, sizes_ptr, cum_ptr, row, order_stride, top, columns, budget, BLOCK)
    tl.store(picked_ptr + row, tl.minimum(tl.maximum(tl.minimum(budget, carry), 0), reach))
    tl.store(covered_ptr + row, covered)
    if ESTIMATE:
        _estimated_ids(order_ptr, plan_ptr, ids_ptr, r, row, plan_stride, order_stride, top, est, read, 0, BLOCK_E,
                       BLOCK_E)  # fmt: skip
    pdl_exit(USE_GDC)


def _cluster_slots_kernel(
    order_ptr, sizes_ptr, offsets_ptr, positions_ptr, plan_ptr, kv_ptr, cum_ptr, picked_ptr, covered_ptr, slots_ptr,
    plan_stride, order_stride, top, columns, total_clusters, total_positions, width, sink, steps,
    HEADS: tl.constexpr, BLOCK_W: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = r * HEADS + h
    num_picked = tl.load(picked_ptr + row)
    covered = tl.load(covered_ptr + row).to(tl.int64)  # the running sums the first kernel wrote
    _slots(order_ptr, sizes_ptr, offsets_ptr, positions_ptr, plan_ptr, kv_ptr, cum_ptr, slots_ptr, r, h, row,
           tl.program_id(2), plan_stride, order_stride, top, columns, total_clusters, total_positions, width, sink,
           steps, num_picked, covered, BLOCK_W)  # fmt: skip
    pdl_exit(USE_GDC)


def _cluster_picks_kernel(
    order_ptr, sizes_ptr, offsets_ptr, positions_ptr, plan_ptr, kv_ptr, cum_ptr, slots_ptr, ids_ptr,
    plan_stride, order_stride, top, columns, total_clusters, total_positions, width, sink, reach, est, steps,
    HEADS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
    ESTIMATE: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """Both kernels' work in one program per (row, KV head, tile of ``BLOCK_W`` slots): its slots, and the
    row's tiles of ``BLOCK_E`` estimated ids dealt round its programs (at the engine's shape one tile or none a
    program: ~14 tiles of slots, ~4 of ids).

    Every program computes its row's running sums itself (as ``_cluster_runs_kernel`` does: tiles of ``BLOCK``
    until past the budget) and stores them to ``cum`` (``[n, H, top]``, one row for all of the row's programs),
    then ``tl.debug_barrier()`` (``bar.sync``: each thread's earlier global stores are visible to every thread of
    its program after it, as ``__syncthreads`` documents), then the binary search over them. Several programs
    store to one row of ``cum`` at once, all the same values (the same inputs, the same integer sums): a program's
    search reads only places it stored itself before the barrier (below ``covered``: the first running sum above
    a picked place is below ``covered``), so it reads its own value or another program's later store of the same
    value, never the buffer's older contents. No program waits for another (no grid-wide sync), so the grid may
    be any size. The interpreter runs programs one after another: there the barrier is a no-op and the row is
    written whole before the search."""
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = r * HEADS + h
    budget = tl.load(plan_ptr + 4 * plan_stride + r)
    carry, read, covered = _running_sums(order_ptr, sizes_ptr, cum_ptr, row, order_stride, top, columns, budget, BLOCK)
    num_picked = tl.minimum(tl.maximum(tl.minimum(budget, carry), 0), reach)
    if ESTIMATE:  # the row's tiles of estimated ids dealt round the row's programs: tile, tile + tiles, ...
        _estimated_ids(order_ptr, plan_ptr, ids_ptr, r, row, plan_stride, order_stride, top, est, read,
                       tl.program_id(2) * BLOCK_E, tl.num_programs(2) * BLOCK_E, BLOCK_E)  # fmt: skip
    tl.debug_barrier()  # the running sums every thread of the program stored, visible to all of them
    _slots(order_ptr, sizes_ptr, offsets_ptr, positions_ptr, plan_ptr, kv_ptr, cum_ptr, slots_ptr, r, h, row,
           tl.program_id(2), plan_stride, order_stride, top, columns, total_clusters, total_positions, width, sink,
           steps, num_picked, covered.to(tl.int64), BLOCK_W)  # fmt: skip
    pdl_exit(USE_GDC)


cluster_runs_kernel = Kernel(_cluster_runs_kernel)
cluster_slots_kernel = Kernel(_cluster_slots_kernel)
cluster_picks_kernel = Kernel(_cluster_picks_kernel)


def cluster_picks_triton(order, sizes, offsets, positions, plan, kv_lens, *, sink, width, reach, est):
    n, heads, top = order.shape
    device = order.device
    if plan.dtype != torch.int64 or plan.stride(1) != 1:
        plan = plan.to(torch.int64).contiguous()  # else its rows at their stride (the arena's plan, sliced)
    if order.dtype != torch.int64 or order.stride(2) != 1 or order.stride(0) != heads * order.stride(1):
        order = order.to(torch.int64).contiguous()  # else rows a fixed stride apart: the sort's first columns
    sizes = sizes.contiguous()
    cum = torch.empty(n, heads, top, dtype=torch.int64, device=device)
    if ONE_LAUNCH:
        slots = torch.empty(n, heads, width, dtype=torch.int64, device=device)
        ids = torch.empty(n, heads, max(est, 1), dtype=torch.int64, device=device)
        cluster_picks_kernel[(n, heads, triton.cdiv(width, BLOCK_W))](
            order, sizes, offsets.contiguous(), positions.contiguous(), plan, kv_lens.to(torch.int64).contiguous(),
            cum, slots, ids, plan.stride(0), order.stride(1), top, sizes.shape[2], offsets.shape[1],
            positions.shape[1], width, sink, reach, max(est, 1), top.bit_length() + 1,
            HEADS=heads, BLOCK=BLOCK, BLOCK_E=BLOCK_E, BLOCK_W=BLOCK_W, ESTIMATE=est > 0, num_warps=4,
            **pdl_args(device),
        )  # fmt: skip
        return slots, (ids if est > 0 else None)
    picked = torch.empty(n, heads, dtype=torch.int64, device=device)
    covered = torch.empty(n, heads, dtype=torch.int32, device=device)
    ids = torch.empty(n, heads, max(est, 1), dtype=torch.int64, device=device)
    cluster_runs_kernel[(n, heads)](
        order, sizes, plan, cum, picked, covered, ids, plan.stride(0), order.stride(1), top, sizes.shape[2], reach,
        max(est, 1),
        HEADS=heads, BLOCK=BLOCK, BLOCK_E=BLOCK_E, ESTIMATE=est > 0, num_warps=4, **pdl_args(device),
    )  # fmt: skip
    slots = torch.empty(n, heads, width, dtype=torch.int64, device=device)
    cluster_slots_kernel[(n, heads, triton.cdiv(width, BLOCK_W))](
        order, sizes, offsets.contiguous(), positions.contiguous(), plan, kv_lens.to(torch.int64).contiguous(),
        cum, picked, covered, slots, plan.stride(0), order.stride(1), top, sizes.shape[2], offsets.shape[1],
        positions.shape[1], width, sink,
        top.bit_length() + 1, HEADS=heads, BLOCK_W=BLOCK_W, num_warps=4, **pdl_args(device),
    )  # fmt: skip
    return slots, (ids if est > 0 else None)
