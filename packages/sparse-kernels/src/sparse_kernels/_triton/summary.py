"""Triton ``block_summary``: one program per (listed block, KV head) reduces the block's valid keys."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel


def _block_summary_kernel(
    k_ptr,
    ids_ptr,
    valid_ptr,
    kmin_ptr,
    kmax_ptr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.load(ids_ptr + i).to(tl.int64)
    n = tl.load(valid_ptr + i)
    if n > 0:
        offs_t = tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_t[:, None] < n) & (offs_d[None, :] < HEAD_DIM)
        slot = block * BLOCK_SIZE + offs_t
        k = tl.load(k_ptr + (slot[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
        k = k.to(tl.float32)
        k_min = tl.min(tl.where(mask, k, float("inf")), 0)
        k_max = tl.max(tl.where(mask, k, float("-inf")), 0)
        dst = (block * NUM_KV_HEADS + h) * HEAD_DIM + offs_d
        # Min and max are existing key values, so narrowing back to the cache dtype is exact.
        tl.store(kmin_ptr + dst, k_min.to(kmin_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
        tl.store(kmax_ptr + dst, k_max.to(kmax_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


block_summary_kernel = Kernel(_block_summary_kernel)


def block_summary_triton(
    k_cache: torch.Tensor, block_ids: torch.Tensor, num_valid: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
) -> None:
    """Inputs already validated by ``sparse_kernels.block_summary``."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_summary_kernel[(block_ids.numel(), num_kv_heads)](
        k_cache,
        block_ids,
        num_valid,
        kmin,
        kmax,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=max(2, triton.next_power_of_2(block_size)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=2,
    )
