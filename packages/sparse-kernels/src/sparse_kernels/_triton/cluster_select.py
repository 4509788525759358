"""Triton ``cluster_select``: a radix select spread over (row, chunk of columns) programs.

Every column gets a rank value (``sparse_kernels.cluster_select.rank_values``, the reference's): an int32 below
``2 ** 23`` whose order is the rank's (the non-negative score's float32 bits without their 7 lowest, less the
group's offset, plus one; 0 for an empty column). Two rounds find, per row and per target (``k1``, ``k2``), the
target-th largest value, 12 + 11 bits at a time (the float bits took 11 + 10 + 10, a launch more): each program
adds the digits of its chunk's values that match the digits found so far into the row's histogram (atomics;
in the first round, where both targets match every value, into one histogram both read), and the last program of
the row to finish (a counter per row) picks the digit. A last pass writes every column
at its place (a target's members: above its threshold, then the tied ones in column order; a program takes the
counts of the chunks before its own from their programs, by a decoupled look-back: each publishes its chunk's
counts and waits for its predecessors'): the retrieved as sort keys, the others as columns; the row's last
program to finish sorts the retrieved keys in registers. The state (histograms, prefixes, counters, look-back
flags) is one buffer per device that every launch leaves at 0: the write pass's programs zero their row's
histograms between them, and its last program of a row the rest of the row's state (no memset launch).

Session 29 tried one program per (row, KV head) in one launch instead (thresholds found bit by bit over the row's
values held in registers, running counts instead of the look-back; a4c4c9d): at batch 5 / 128K on the H200 (40
rows of 8208 columns) it took 75 us a call at 16 warps (114 at 8, 89 at 32) against these three launches' 37
(``results/bench/h200/session29/select_c2``): a row's serial steps cost more than the launches they save.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton import scratch
from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit
from sparse_kernels.cluster_select import RANK_BITS, RANK_DROP, rank_offset

CHUNK = 1024  # columns per program
MAX_VALUE = (1 << RANK_BITS) - 1  # rank values are at most this
SHIFT = 24  # sort key of a retrieved column: (MAX_VALUE - rank value) << SHIFT | column, below 2 ** 47
PAD = 1 << 62
ROUNDS = ((11, 4096), (0, 2048))  # (shift, bins): 12 + 11 bits of the 23-bit values
NUM_WARPS = 4


@triton.jit
def _last_of_row(count_ptr, row, chunks):
    """True in the row's last program to get here; it resets the counter for the next round."""
    tl.debug_barrier()  # the program's stores come before its arrival
    done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == chunks - 1
    if done:
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed")
    return done


@triton.jit
def _reduce(hist_ptr, prefix_ptr, above_ptr, row, t, src, k, shift, BINS: tl.constexpr):
    """Target ``t``'s round: the digit of its ``k``-th largest value among the matching ones (``above`` of its
    values lie above their range), counted in histogram ``src``; the prefix and ``above`` move to the digit's bin."""
    d = tl.arange(0, BINS)
    hist = tl.load(hist_ptr + (row * 2 + src) * BINS + d, cache_modifier=".cg")
    above = tl.load(above_ptr + row * 2 + t)
    at_least = tl.sum(hist, axis=0) - (tl.cumsum(hist, axis=0) - hist)  # values with digit >= d
    digit = tl.sum((above + at_least >= k).to(tl.int32), axis=0) - 1
    tl.store(above_ptr + row * 2 + t, above + tl.sum(tl.where(d > digit, hist, 0), axis=0))
    tl.store(prefix_ptr + row * 2 + t, tl.load(prefix_ptr + row * 2 + t) + (digit.to(tl.int64) << shift))


@triton.jit
def _counts(ret_ptr, est_ptr, row, heads, columns, read_width, est_width):
    b = row // heads
    k1 = tl.minimum(tl.maximum(tl.load(ret_ptr + b), 0), tl.minimum(read_width, columns))
    k2 = tl.minimum(k1 + tl.minimum(tl.maximum(tl.load(est_ptr + b), 0), est_width), columns)
    return k1, k2


def _select_round_kernel(
    logit_ptr, size_ptr, tmax_ptr, tsum_ptr, ret_ptr, est_ptr, value_ptr, hist_ptr, count_ptr, prefix_ptr,
    above_ptr, columns, tiles, heads, read_width, est_width, chunks, shift, digit_bits,
    FIRST: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
    BINS: tl.constexpr, DROP: tl.constexpr, OFFSET: tl.constexpr, MAX_VALUE: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    row = tl.program_id(0).to(tl.int64)  # (decode row, KV head)
    chunk = tl.program_id(1)
    col = chunk * CHUNK + tl.arange(0, CHUNK)
    cm = col < columns
    if FIRST:  # the rank values, from the logits and the merged tile statistics
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
        safe = tl.where(top_m == float("-inf"), 0.0, top_m)
        total = tl.where(total > 0, total, 1.0)
        size = tl.load(size_ptr + row * columns + col, mask=cm, other=0)
        lg = tl.load(
            logit_ptr + (row * GROUP + g)[:, None] * columns + col[None, :], mask=gm[:, None] & cm[None, :],
            other=float("-inf"),
        )  # fmt: skip
        live = cm & (size > 0)  # the logits' load did not wait for the sizes: an empty column is dropped here
        keep = gm[:, None] & live[None, :]
        p = tl.sum(tl.where(keep, tl.exp(lg - safe[:, None]) / total[:, None], 0.0), axis=0) + 0.0
        truncated = (p.to(tl.int32, bitcast=True) >> DROP) - OFFSET  # as rank_values
        value = tl.where(live, tl.minimum(tl.maximum(truncated, 0), MAX_VALUE - 1) + 1, 0)
        tl.store(value_ptr + row * columns + col, value, mask=cm)
        v = value.to(tl.int64)
    else:
        v = tl.load(value_ptr + row * columns + col, mask=cm, other=0).to(tl.int64)
    high = shift + digit_bits  # the bits above this round's digit: the prefix's so far
    m1 = cm & ((v >> high) == (tl.load(prefix_ptr + row * 2) >> high))
    m2 = cm & ((v >> high) == (tl.load(prefix_ptr + row * 2 + 1) >> high))
    digit = ((v >> shift) & (BINS - 1)).to(tl.int32)
    tl.atomic_add(hist_ptr + (row * 2) * BINS + digit, 1, mask=m1, sem="relaxed")
    if not FIRST:  # the first round's prefixes are both 0: one histogram serves both targets
        tl.atomic_add(hist_ptr + (row * 2 + 1) * BINS + digit, 1, mask=m2, sem="relaxed")
    if _last_of_row(count_ptr, row, chunks):
        k1, k2 = _counts(ret_ptr, est_ptr, row, heads, columns, read_width, est_width)
        _reduce(hist_ptr, prefix_ptr, above_ptr, row, 0, 0, k1, shift, BINS)
        _reduce(hist_ptr, prefix_ptr, above_ptr, row, 1, 0 if FIRST else 1, k2, shift, BINS)
    pdl_exit(USE_GDC)


@triton.jit
def _counts_before(agg_ptr, flag_ptr, row, chunk, chunks, over1, same1, over2, same2, BLOCK_CH: tl.constexpr):
    """Publish this chunk's four counts, then sum those of the row's chunks before it (decoupled look-back: a
    chunk's program waits until each earlier chunk's program has published; chunks are handed out in the order
    programs start, so an earlier chunk's program is running or done and the wait ends)."""
    j = tl.arange(0, 4)
    mine = tl.where(j == 0, over1, tl.where(j == 1, same1, tl.where(j == 2, over2, same2)))
    tl.store(agg_ptr + (row * chunks + chunk) * 4 + j, mine)
    tl.debug_barrier()  # every thread's counts precede the flag
    tl.atomic_xchg(flag_ptr + row * chunks + chunk, 1, sem="release")
    c = tl.arange(0, BLOCK_CH)
    before = c < chunk
    flags = row * chunks + c
    ready = tl.sum(tl.where(before, tl.atomic_add(flag_ptr + flags, 0, mask=before, sem="acquire"), 0), axis=0)
    while ready < chunk:
        ready = tl.sum(tl.where(before, tl.atomic_add(flag_ptr + flags, 0, mask=before, sem="acquire"), 0), axis=0)
    agg = tl.load(agg_ptr + flags[:, None] * 4 + j[None, :], mask=before[:, None], other=0, cache_modifier=".cg")
    total = tl.sum(agg, axis=0)  # [4]
    return _entry(total, j, 0), _entry(total, j, 1), _entry(total, j, 2), _entry(total, j, 3)


@triton.jit
def _entry(vector, j, i):
    return tl.sum(tl.where(j == i, vector, 0), axis=0)


@triton.jit
def _zero_share(ptr, size, chunk, chunks, ZB: tl.constexpr):
    """Program ``chunk`` of ``chunks`` zeroes its share of ``size`` int32 at ``ptr``: every ``chunks``-th tile."""
    for t in range(chunk * ZB, size, chunks * ZB):
        z = t + tl.arange(0, ZB)
        tl.store(ptr + z, tl.zeros([ZB], tl.int32), mask=z < size)


def _select_write_kernel(
    ret_ptr, est_ptr, value_ptr, count_ptr, prefix_ptr, above_ptr, ticket_ptr, flag_ptr, agg_ptr, out_ptr, columns,
    heads, read_width, est_width, chunks, hist_ptr, rows,
    CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_CH: tl.constexpr, BINS0: tl.constexpr, BINS1: tl.constexpr,
    SHIFT: tl.constexpr, PAD: tl.constexpr, MAX_VALUE: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.atomic_add(ticket_ptr + row, 1, sem="relaxed")  # chunks in the order the row's programs start
    # The rounds are done with the row's histograms: its programs share zeroing them for the next call.
    _zero_share(hist_ptr + row * (2 * BINS0), 2 * BINS0, chunk, chunks, 1024)
    _zero_share(hist_ptr + rows * (2 * BINS0) + row * (2 * BINS1), 2 * BINS1, chunk, chunks, 1024)
    k1, k2 = _counts(ret_ptr, est_ptr, row, heads, columns, read_width, est_width)
    p1 = tl.load(prefix_ptr + row * 2)
    p2 = tl.load(prefix_ptr + row * 2 + 1)
    a1 = tl.load(above_ptr + row * 2)
    a2 = tl.load(above_ptr + row * 2 + 1)
    col = chunk * CHUNK + tl.arange(0, CHUNK)
    cm = col < columns
    v = tl.load(value_ptr + row * columns + col, mask=cm, other=0).to(tl.int64)
    eq1 = (cm & (v == p1)).to(tl.int32)
    eq2 = (cm & (v == p2)).to(tl.int32)
    over1, tie1, over2, tie2 = _counts_before(
        agg_ptr, flag_ptr, row, chunk, chunks, tl.sum((cm & (v > p1)).to(tl.int32), axis=0), tl.sum(eq1, axis=0),
        tl.sum((cm & (v > p2)).to(tl.int32), axis=0), tl.sum(eq2, axis=0), BLOCK_CH,
    )  # fmt: skip
    n1 = over1 + tl.minimum(tie1, k1 - a1)  # members in the chunks before: ties go in column order
    n2 = over2 + tl.minimum(tie2, k2 - a2)
    in1 = cm & ((v > p1) | ((eq1 > 0) & (tie1 + tl.cumsum(eq1, axis=0) - eq1 < k1 - a1)))
    in2 = cm & ((v > p2) | ((eq2 > 0) & (tie2 + tl.cumsum(eq2, axis=0) - eq2 < k2 - a2)))
    r = in1.to(tl.int32)
    e = (in2 & ~in1).to(tl.int32)
    o = (cm & ~in2).to(tl.int32)
    at1 = n1 + tl.cumsum(r, axis=0) - r
    at2 = k1 + (n2 - n1) + tl.cumsum(e, axis=0) - e
    at3 = k2 + (chunk * CHUNK - n2) + tl.cumsum(o, axis=0) - o  # the chunks before are full
    key = ((MAX_VALUE - v) << SHIFT) | col.to(tl.int64)
    tl.store(out_ptr + row * columns + at1, key, mask=in1)
    tl.store(out_ptr + row * columns + tl.where(e > 0, at2, at3), col.to(tl.int64), mask=cm & ~in1)
    if _last_of_row(count_ptr, row, chunks):  # every retrieved key is in place: sort them
        i = tl.arange(0, BLOCK_R)
        keys = tl.sort(tl.load(out_ptr + row * columns + i, mask=i < k1, other=PAD, cache_modifier=".cg"))
        tl.store(out_ptr + row * columns + i, keys & ((1 << SHIFT) - 1), mask=i < k1)
        # Every program of the row has read its state: the row's state goes back to 0 for the next call.
        j = tl.arange(0, 2)
        tl.store(prefix_ptr + row * 2 + j, tl.zeros([2], tl.int64))
        tl.store(above_ptr + row * 2 + j, tl.zeros([2], tl.int64))
        tl.store(ticket_ptr + row, 0)
        c = tl.arange(0, BLOCK_CH)
        tl.store(flag_ptr + row * chunks + c, tl.zeros([BLOCK_CH], tl.int32), mask=c < chunks)
        q = tl.arange(0, 4)
        tl.store(agg_ptr + (row * chunks + c[:, None]) * 4 + q[None, :], tl.zeros([BLOCK_CH, 4], tl.int32),
                 mask=(c < chunks)[:, None])  # fmt: skip
    pdl_exit(USE_GDC)


select_round_kernel = Kernel(_select_round_kernel)
select_write_kernel = Kernel(_select_write_kernel)


_STATE: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _state(device: torch.device, numel: int) -> torch.Tensor:
    """The selection's int64 state of ``device`` (prefixes, counts, counters, histograms, look-back flags): zero
    when allocated, and every launch leaves what it used at 0 again (the module docstring says who resets what),
    so one buffer serves every call without a memset launch (``scratch.grown``)."""
    return scratch.grown(_STATE, device, ((numel, torch.int64, True),))[0]


def cluster_select_triton(logits, sizes, tile_max, tile_sum, retrieved, estimated, read_width: int, est_width: int):
    n, heads, group, columns = logits.shape
    if columns >= 1 << SHIFT:
        raise ValueError(f"at most {(1 << SHIFT) - 1} cluster columns, got {columns}")
    rows, tiles = n * heads, tile_max.shape[-1]
    device = logits.device
    chunk = min(CHUNK, max(16, triton.next_power_of_2(columns)))
    chunks = triton.cdiv(columns, chunk)
    out = torch.empty(n, heads, columns, dtype=torch.int64, device=device)
    values = torch.empty(rows, columns, dtype=torch.int32, device=device)
    hist_size = sum(rows * 2 * bins for _, bins in ROUNDS)
    look_back = rows + rows * chunks * 5  # int32: tickets per row, flags and four counts per (row, chunk)
    state = _state(device, 4 * rows + rows + hist_size // 2 + (look_back + 1) // 2)
    prefix, above = state[: 2 * rows], state[2 * rows : 4 * rows]  # per row and target
    count = state[4 * rows : 5 * rows].view(torch.int32)[:rows]  # programs of the row done, per kernel
    hist = state[5 * rows : 5 * rows + hist_size // 2].view(torch.int32)  # per round, row and target
    tail = state[5 * rows + hist_size // 2 :].view(torch.int32)
    tickets, flags, aggs = tail[:rows], tail[rows : rows + rows * chunks], tail[rows + rows * chunks : look_back]
    counts = (retrieved.to(torch.int64).contiguous(), estimated.to(torch.int64).contiguous())
    logits, sizes = logits.contiguous(), sizes.to(torch.int32).contiguous()
    tile_max, tile_sum = tile_max.contiguous(), tile_sum.contiguous()
    at = 0
    for i, (shift, bins) in enumerate(ROUNDS):
        select_round_kernel[(rows, chunks)](
            logits, sizes, tile_max, tile_sum, *counts, values, hist[at : at + rows * 2 * bins], count, prefix,
            above, columns, tiles, heads, read_width, est_width, chunks, shift, bins.bit_length() - 1,
            FIRST=i == 0, GROUP=group, BLOCK_G=triton.next_power_of_2(group),
            BLOCK_T=min(64, triton.next_power_of_2(tiles)), CHUNK=chunk, BINS=bins, DROP=RANK_DROP,
            OFFSET=rank_offset(group), MAX_VALUE=MAX_VALUE, num_warps=NUM_WARPS, **pdl_args(device),
        )  # fmt: skip
        at += rows * 2 * bins
    select_write_kernel[(rows, chunks)](
        *counts, values, count, prefix, above, tickets, flags, aggs, out, columns, heads, read_width, est_width, chunks,
        hist, rows, CHUNK=chunk, BLOCK_R=max(16, triton.next_power_of_2(read_width)), BINS0=ROUNDS[0][1],
        BINS1=ROUNDS[1][1],
        BLOCK_CH=max(2, triton.next_power_of_2(chunks)), SHIFT=SHIFT, PAD=PAD, MAX_VALUE=MAX_VALUE, num_warps=NUM_WARPS,
        **pdl_args(device),
    )  # fmt: skip
    return out
