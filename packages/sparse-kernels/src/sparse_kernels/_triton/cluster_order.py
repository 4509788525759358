"""Triton ``cluster_order``: score and sort chunks of each row's columns in registers, then place every key at
its rank in the row (its place in its chunk plus, per other chunk, a binary search for the keys below it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel

CHUNK = 2048  # columns sorted per program
SLICE = 128  # keys placed per program of the merge
SHIFT = 24  # key = descending score bits << SHIFT | column
PAD = 1 << 62  # past the row's columns: after every key
# On the H200 at batch 5 / 128K (40 rows x 8320 columns, top 5426), both kernels per layer: chunks of 2048 sorted
# by 16 warps 81 us, by 8 warps 97 us; chunks of 1024 or 4096 101-165 us (``benchmarks/retroinfer_kernel_probe.py``,
# ``results/bench/h200/session12``). A merge that compared each slice with the window of keys between its first
# and last in every other chunk, instead of a binary search per key, took 185-720 us (compare-bound).
CHUNK_WARPS = 16
MERGE_WARPS = 4


def _order_chunks_kernel(
    logit_ptr, size_ptr, tmax_ptr, tsum_ptr, key_ptr, order_ptr, columns, tiles, top, chunks,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
    SHIFT: tl.constexpr, PAD: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (decode row, KV head)
    c = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP
    top_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    for t0 in range(0, tiles, BLOCK_T):  # merge the tiles' softmax statistics per query head
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
    total = tl.where(total > 0, total, 1.0)  # no live cluster: every score is -inf below
    col = c * CHUNK + tl.arange(0, CHUNK)
    cm = col < columns
    size = tl.load(size_ptr + row * columns + col, mask=cm, other=0)
    live = cm & (size > 0)
    lg = tl.load(
        logit_ptr + (row * GROUP + g)[:, None] * columns + col[None, :], mask=gm[:, None] & live[None, :],
        other=float("-inf"),
    )  # fmt: skip
    p = tl.sum(tl.where(gm[:, None], tl.exp(lg - safe[:, None]) / total[:, None], 0.0), axis=0)
    score = tl.where(live, p, float("-inf")) + 0.0  # -0.0 ranks as 0.0
    bits = score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    ascending = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    key = ((0xFFFFFFFF - ascending) << SHIFT) | col.to(tl.int64)
    key = tl.sort(tl.where(cm, key, PAD))
    i = tl.arange(0, CHUNK)
    if DIRECT:  # the row is this one chunk: its sorted keys are the order
        tl.store(order_ptr + row * top + i, key & ((1 << SHIFT) - 1), mask=i < top)
    else:
        tl.store(key_ptr + (row * chunks + c) * CHUNK + i, key)


def _order_merge_kernel(
    key_ptr, order_ptr, top, chunks,
    CHUNK: tl.constexpr, SLICE: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, SHIFT: tl.constexpr,
    PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    i = tl.program_id(2) * SLICE + tl.arange(0, SLICE)
    v = tl.load(key_ptr + (row * chunks + c) * CHUNK + i)  # [SLICE], ascending
    other = tl.arange(0, BLOCK_K)
    om = (other < chunks) & (other != c)
    lo = tl.zeros([BLOCK_K, SLICE], tl.int32)
    hi = tl.zeros([BLOCK_K, SLICE], tl.int32) + CHUNK
    base = (row * chunks + other) * CHUNK
    for _ in range(STEPS):  # per other chunk, its keys below v (they are unique but for PAD)
        active = lo < hi
        mid = (lo + hi) // 2
        a = tl.load(key_ptr + base[:, None] + tl.minimum(mid, CHUNK - 1), mask=om[:, None] & active, other=PAD)
        below = a < v[None, :]
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    rank = i + tl.sum(tl.where(om[:, None], lo, 0), axis=0)
    tl.store(order_ptr + row * top + rank, v & ((1 << SHIFT) - 1), mask=(v != PAD) & (rank < top))


order_chunks_kernel = Kernel(_order_chunks_kernel)
order_merge_kernel = Kernel(_order_merge_kernel)


def cluster_order_triton(logits, sizes, tile_max, tile_sum, top: int, chunk: int = CHUNK) -> torch.Tensor:
    n, heads, group, columns = logits.shape
    tiles = tile_max.shape[-1]
    if columns >= 1 << SHIFT:
        raise ValueError(f"at most {(1 << SHIFT) - 1} cluster columns, got {columns}")
    chunk = min(chunk, max(16, triton.next_power_of_2(columns)))
    chunks = triton.cdiv(columns, chunk)
    rows = n * heads
    device = logits.device
    order = torch.empty(n, heads, top, dtype=torch.int64, device=device)
    keys = order if chunks == 1 else torch.empty(rows, chunks, chunk, dtype=torch.int64, device=device)
    common = dict(CHUNK=chunk, SHIFT=SHIFT, PAD=PAD)
    order_chunks_kernel[(rows, chunks)](
        logits.contiguous(), sizes.to(torch.int32).contiguous(), tile_max.contiguous(), tile_sum.contiguous(),
        keys, order, columns, tiles, top, chunks, GROUP=group, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_T=min(64, triton.next_power_of_2(tiles)), DIRECT=chunks == 1, **common, num_warps=CHUNK_WARPS,
    )  # fmt: skip
    if chunks > 1:
        order_merge_kernel[(rows, chunks, chunk // min(SLICE, chunk))](
            keys, order, top, chunks, SLICE=min(SLICE, chunk), BLOCK_K=triton.next_power_of_2(chunks),
            STEPS=chunk.bit_length(), **common, num_warps=MERGE_WARPS,
        )  # fmt: skip
    return order
