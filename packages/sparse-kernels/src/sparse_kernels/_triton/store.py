"""Triton ``store_kv``: one program per new row; rows with slot ``-1`` skip the pool. Program ``i <
n_copy`` also copies row ``i`` of ``copy_rows`` (all its heads) to row ``copy_index[i]`` of ``copy_into``.
With ``SUMMARY`` each stored row also updates its block's summary (``update_block_summaries``): float
summaries widened with the new key, or int8 codes re-encoded from the block's keys through the new one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit
from sparse_kernels._triton.summary import encode_codes


def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    copy_rows_ptr,
    copy_into_ptr,
    copy_index_ptr,
    kmin_ptr,
    kmax_ptr,
    scale_ptr,
    n_copy,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cn,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    SUMMARY: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    COPY_HEADS: tl.constexpr,
    COPY_BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)  # step metadata from the host: read before the wait
    copies = row < n_copy  # n_copy is 0 when the call copies nothing
    dest = tl.load(copy_index_ptr + row, mask=copies, other=0).to(tl.int64)  # likewise
    if slot >= 0 or copies:
        pdl_enter(USE_GDC)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)  # flattened (head, dim) of one row
        mask = offs < NUM_KV_HEADS * HEAD_DIM
        head, dim = offs // HEAD_DIM, offs % HEAD_DIM
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs  # int64: pools can exceed 2**31 elements
        k = tl.load(key_ptr + row * stride_kn + head * stride_kh + dim, mask=mask)
        v = tl.load(value_ptr + row * stride_vn + head * stride_vh + dim, mask=mask)
        # With a summary, its loads are issued before the stores too (none reads the slot written here):
        # the pointers may alias, so the compiler would otherwise wait for each store before the next load.
        if SUMMARY != 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            lo = k.to(tl.float32)
            hi = lo
            if SUMMARY == 1:  # float summaries: widen the block's with the key; offset 0 starts it afresh
                sdst = block * (NUM_KV_HEADS * HEAD_DIM) + offs
                if offset != 0:
                    lo = tl.minimum(lo, tl.load(kmin_ptr + sdst, mask=mask, other=0.0).to(tl.float32))
                    hi = tl.maximum(hi, tl.load(kmax_ptr + sdst, mask=mask, other=0.0).to(tl.float32))
            if SUMMARY == 2:  # int8 codes: the block's keys [0, offset] summarised afresh
                # The earlier tokens from the pool (no other row of the step writes this block), the new
                # key from registers.
                offs_t = tl.arange(0, BLOCK_T)
                earlier = (offs_t[:, None] < offset) & mask[None, :]
                src = (block * BLOCK_SIZE + offs_t[:, None]) * (NUM_KV_HEADS * HEAD_DIM) + offs[None, :]
                prev = tl.load(k_cache_ptr + src, mask=earlier, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK]
                lo = tl.minimum(lo, tl.min(tl.where(earlier, prev, float("inf")), 0))
                hi = tl.maximum(hi, tl.max(tl.where(earlier, prev, float("-inf")), 0))
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)
        if SUMMARY == 1:
            # Min and max are existing key values, so narrowing to the summary dtype is exact.
            tl.store(kmin_ptr + sdst, lo.to(kmin_ptr.dtype.element_ty), mask=mask)
            tl.store(kmax_ptr + sdst, hi.to(kmax_ptr.dtype.element_ty), mask=mask)
        if SUMMARY == 2:
            # Encoded per KV head (``encode_codes``, as ``block_summary``): the launcher guarantees BLOCK ==
            # NUM_KV_HEADS * HEAD_DIM here, so the row reshapes to [heads, head_dim].
            heads = tl.arange(0, NUM_KV_HEADS)
            lo, hi = encode_codes(
                tl.reshape(lo, (NUM_KV_HEADS, HEAD_DIM)),
                tl.reshape(hi, (NUM_KV_HEADS, HEAD_DIM)),
                heads[:, None] < NUM_KV_HEADS,  # every channel valid
                scale_ptr + block * NUM_KV_HEADS + heads,
            )
            cdst = (block * NUM_KV_HEADS + heads[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
            tl.store(kmin_ptr + cdst, lo.to(kmin_ptr.dtype.element_ty))
            tl.store(kmax_ptr + cdst, hi.to(kmax_ptr.dtype.element_ty))
    if copies:
        offs = tl.arange(0, COPY_BLOCK)
        mask = offs < COPY_HEADS * HEAD_DIM
        head, dim = offs // HEAD_DIM, offs % HEAD_DIM
        x = tl.load(copy_rows_ptr + row * stride_cn + head * stride_ch + dim, mask=mask)
        tl.store(copy_into_ptr + dest * (COPY_HEADS * HEAD_DIM) + offs, x, mask=mask)
    if slot >= 0 or copies:
        pdl_exit(USE_GDC)


store_kv_kernel = Kernel(_store_kv_kernel)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    summary: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> None:
    """Inputs already validated by ``sparse_kernels.store_kv``; any row/head strides are read in place.
    ``copy``: ``(rows [n, H, D], into [R, H, D], index [>= n])`` (see ``store_kv``), or None. ``summary``:
    ``(kmin, kmax, scale)`` (``update_block_summaries``), or None."""
    num_rows, num_kv_heads, head_dim = key.shape
    _, block_size = k_cache.shape[:2]
    kmin, kmax, scale = summary if summary is not None else (k_cache, k_cache, None)
    mode = 0 if summary is None else (1 if scale is None else 2)
    block = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = max(2, triton.next_power_of_2(block_size)) if mode == 2 else 1
    # int8 codes fuse when the row reshapes to [heads, head_dim] (the per-head encode) and the block's
    # earlier keys fit one register tile: on an H200 (8 x 128 bf16 heads, 64 rows, CUDA-graph replays) 2.5 us
    # against 4.2 for the store and the summary kernel at block_size 16, 3.3 against 4.4 at 32, but 6 to 9
    # against 5 at 64.
    per_head = triton.next_power_of_2(head_dim) == head_dim and block == num_kv_heads * head_dim
    if mode == 2 and not (per_head and block_t <= _MAX_FUSED_BLOCK_T):
        mode, block_t = 0, 1  # stored here, summarised by the separate kernel below
    # Codes: warps enough that the tile's columns alone spread the threads, 16 bytes each, so the reduction
    # over the block's tokens stays within each thread (4 warps for 8 x 128 bf16; 8 warps there: 2x slower).
    warps = 4 if mode != 2 else max(1, min(16, block * k_cache.element_size() // 512))
    # Cast outside the kernel: torch rounds to nearest-even, like the reference (Triton's interpreter
    # truncates on fp32 -> bf16); a unit-stride last dim keeps the row loads contiguous.
    key = key.to(k_cache.dtype)
    value = value.to(v_cache.dtype)
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    rows, into, index = copy if copy is not None else (key, key, slot_mapping)
    if rows.dim() != 3 or rows.shape[-1] != head_dim:
        raise ValueError(f"copy_rows must be [n, H, {head_dim}]; got {tuple(rows.shape)}")
    copy_heads = rows.shape[1] if copy is not None else 0
    store_kv_kernel[(num_rows,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        rows,
        into,
        index,
        kmin,
        kmax,
        kmin if scale is None else scale,
        rows.shape[0] if copy is not None else 0,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        rows.stride(0),
        rows.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=block,
        SUMMARY=mode,
        BLOCK_SIZE=block_size if mode else 1,
        BLOCK_T=block_t,
        COPY_HEADS=copy_heads,
        COPY_BLOCK=triton.next_power_of_2(max(copy_heads, 1) * head_dim),
        num_warps=warps,
        **pdl_args(key.device),
    )
    if summary is not None and mode == 0:
        from sparse_kernels.summary_update import update_block_summaries

        update_block_summaries(k_cache, slot_mapping, kmin, kmax, scale=scale, backend="triton")


_MAX_FUSED_BLOCK_T = 32
