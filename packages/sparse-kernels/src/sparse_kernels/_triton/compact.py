"""Triton ``compact_kv``: one program per (request, KV head) moves kept rows forward, in order.

Safe in place because each ``keep`` row is strictly increasing, so ``keep[h, i] >= i``: chunk ``c``
writes list positions ``[cB, cB + B)`` and every later chunk reads positions ``>= (c + 1) B``. Inside
one chunk a read position may equal another row's write position, so a barrier separates the chunk's
loads from its stores. ``keep`` may have a head stride of 0 (one row shared by every KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel


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
    slot_lo = tl.load(slot_indptr_ptr + r)
    keep_lo = tl.load(keep_indptr_ptr + r)
    num_keep = tl.load(keep_indptr_ptr + r + 1) - keep_lo
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for i0 in range(0, num_keep, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        mask = offs < num_keep
        src_pos = tl.load(keep_ptr + h * stride_keep_h + keep_lo + offs, mask=mask, other=0)
        src = tl.load(slot_ids_ptr + slot_lo + src_pos, mask=mask, other=0).to(tl.int64)
        dst = tl.load(slot_ids_ptr + slot_lo + offs, mask=mask, other=0).to(tl.int64)
        m2 = mask[:, None] & mask_d[None, :]
        src_off = (src[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
        dst_off = (dst[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + src_off, mask=m2)
        v = tl.load(v_ptr + src_off, mask=m2)
        tl.debug_barrier()  # every thread's reads land before any thread overwrites a source row
        tl.store(k_ptr + dst_off, k, mask=m2)
        tl.store(v_ptr + dst_off, v, mask=m2)


compact_kernel = Kernel(_compact_kernel)


# Rows per chunk and warps per program. A faster walk (the next chunk's slot ids prefetched, rows already
# in place skipped: 9041cf4, 1.61 vs 1.84 ms per layer at the b91 round, 0.15 vs 0.48 at b5) failed the
# GPU hazard test (test_compact.py::test_round_shape_on_the_gpu_equals_the_reference) on the H200 and
# was taken out until that is understood.
BLOCK_ROWS = 64
NUM_WARPS = 4


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
