"""Triton ``compact_kv``: one program per (request, KV head) moves kept rows forward, in order.

Safe in place because each ``keep`` row is strictly increasing, so ``keep[h, i] >= i``: chunk ``c``
writes list positions ``[cB, cB + B)`` and every later chunk reads positions ``>= (c + 1) B``. Inside
one chunk a read position may equal another row's write position, so a barrier separates the chunk's
loads from its stores; nothing orders a later chunk's loads after an earlier chunk's stores.

The walk over chunks is serial, so it is latency-bound unless each step waits for one memory round
trip only: the K/V loads of chunk ``c`` go out together with the slot loads of chunk ``c + 1`` and the
kept positions of chunk ``c + 2`` (read-only inputs, prefetched into registers), then the barrier, then
chunk ``c``'s stores. A row with ``keep[h, i] == i`` already sits in place (the leading rows before
the first eviction): it is masked out, neither read nor written, and no other row reads its position
(another row ``j < i`` with ``keep[h, j] == i`` would break the strict order).

``keep`` may have a head stride of 0 (one row shared by every KV head, an ``expand``): each program
reads its head's row through ``stride_keep_h``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel

# Rows per chunk and warps per program: each step of a program has BLOCK_ROWS K and V rows in flight
# (64 KiB at head_dim 128 in bf16), held in registers across the barrier. 128 x 4 warps compiles to
# about 190 registers a thread for sm_90, so two programs share an SM and one's loads overlap the
# other's barrier and stores. benchmarks/eviction_round_kernels.py times the alternatives (SWEEP).
BLOCK_ROWS = 128
NUM_WARPS = 4


def _compact_kernel(
    k_ptr,
    v_ptr,
    slot_indptr_ptr,
    slot_ids_ptr,
    keep_indptr_ptr,
    keep_ptr,
    stride_keep_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    slots = slot_ids_ptr + tl.load(slot_indptr_ptr + r)
    keep_lo = tl.load(keep_indptr_ptr + r)
    num_keep = tl.load(keep_indptr_ptr + r + 1) - keep_lo
    keep_row = keep_ptr + h * stride_keep_h + keep_lo
    rows = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    col = h * HEAD_DIM + offs_d  # the head's columns within a slot's [NUM_KV_HEADS * HEAD_DIM] row
    # Prologue: chunk 0's slots (moving rows only) and chunk 1's kept positions.
    pos = tl.load(keep_row + rows, mask=rows < num_keep, other=0)
    moving = (rows < num_keep) & (pos != rows)
    src = tl.load(slots + pos, mask=moving, other=0)
    dst = tl.load(slots + rows, mask=moving, other=0)
    pos_next = tl.load(keep_row + BLOCK + rows, mask=BLOCK + rows < num_keep, other=0)
    for i0 in range(0, num_keep, BLOCK):
        m2 = moving[:, None] & mask_d[None, :]
        src_off = src.to(tl.int64)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + col[None, :]
        k = tl.load(k_ptr + src_off, mask=m2)
        v = tl.load(v_ptr + src_off, mask=m2)
        # The next chunk's slots and the positions after them: read-only, so they share this round trip.
        nxt = i0 + BLOCK + rows
        moving_next = (nxt < num_keep) & (pos_next != nxt)
        src_next = tl.load(slots + pos_next, mask=moving_next, other=0)
        dst_next = tl.load(slots + nxt, mask=moving_next, other=0)
        pos_next = tl.load(keep_row + BLOCK + nxt, mask=BLOCK + nxt < num_keep, other=0)
        tl.debug_barrier()  # every thread's reads of this chunk land before any thread overwrites a source row
        dst_off = dst.to(tl.int64)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + col[None, :]
        tl.store(k_ptr + dst_off, k, mask=m2)
        tl.store(v_ptr + dst_off, v, mask=m2)
        src, dst, moving = src_next, dst_next, moving_next


compact_kernel = Kernel(_compact_kernel)


def compact_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_indptr: torch.Tensor,
    slot_ids: torch.Tensor,
    keep_indptr: torch.Tensor,
    keep: torch.Tensor,
    *,
    block_rows: int = BLOCK_ROWS,
    num_warps: int = NUM_WARPS,
) -> None:
    """Inputs already validated by ``sparse_kernels.compact_kv``; ``keep``'s columns contiguous (its head
    stride may be 0). ``block_rows`` / ``num_warps``: the launch (tests and benchmarks change them)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    compact_kernel[(slot_indptr.numel() - 1, num_kv_heads)](
        k_cache,
        v_cache,
        slot_indptr,
        slot_ids,
        keep_indptr,
        keep,
        keep.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=block_rows,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=num_warps,
        num_stages=1,
    )
