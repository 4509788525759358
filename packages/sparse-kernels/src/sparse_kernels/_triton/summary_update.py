"""Triton ``update_block_summaries``: one program per (slot, KV head) folds the new key into its block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _update_summary_kernel(
    k_ptr,
    slots_ptr,
    kmin_ptr,
    kmax_ptr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, BLOCK_D)
        mask = offs_d < HEAD_DIM
        block = slot // BLOCK_SIZE
        key = tl.load(k_ptr + (slot * NUM_KV_HEADS + h) * HEAD_DIM + offs_d, mask=mask, other=0.0)
        key = key.to(tl.float32)
        dst = (block * NUM_KV_HEADS + h) * HEAD_DIM + offs_d
        lo = key
        hi = key
        if slot % BLOCK_SIZE != 0:  # widen the block's summary; offset 0 starts it afresh
            lo = tl.minimum(lo, tl.load(kmin_ptr + dst, mask=mask, other=0.0).to(tl.float32))
            hi = tl.maximum(hi, tl.load(kmax_ptr + dst, mask=mask, other=0.0).to(tl.float32))
        # Min and max are existing key values, so narrowing to the summary dtype is exact.
        tl.store(kmin_ptr + dst, lo.to(kmin_ptr.dtype.element_ty), mask=mask)
        tl.store(kmax_ptr + dst, hi.to(kmax_ptr.dtype.element_ty), mask=mask)
    pdl_exit(USE_GDC)


update_summary_kernel = Kernel(_update_summary_kernel)


def update_block_summaries_triton(
    k_cache: torch.Tensor, slot_mapping: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
) -> None:
    """Inputs already validated by ``sparse_kernels.update_block_summaries``."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    update_summary_kernel[(slot_mapping.numel(), num_kv_heads)](
        k_cache,
        slot_mapping,
        kmin,
        kmax,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
        **pdl_args(k_cache.device),
    )
