"""Triton ``store_kv``: one program per new row; rows with slot ``-1`` return before touching memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)  # step metadata from the host: read before the wait
    if slot >= 0:
        pdl_enter(USE_GDC)
        offs = tl.arange(0, BLOCK)  # flattened (head, dim) of one row
        mask = offs < NUM_KV_HEADS * HEAD_DIM
        head, dim = offs // HEAD_DIM, offs % HEAD_DIM
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs  # int64: pools can exceed 2**31 elements
        k = tl.load(key_ptr + row * stride_kn + head * stride_kh + dim, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(value_ptr + row * stride_vn + head * stride_vh + dim, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)
        pdl_exit(USE_GDC)


store_kv_kernel = Kernel(_store_kv_kernel)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Inputs already validated by ``sparse_kernels.store_kv``; any row/head strides are read in place."""
    num_rows, num_kv_heads, head_dim = key.shape
    # Cast outside the kernel: torch rounds to nearest-even, like the reference (Triton's interpreter
    # truncates on fp32 -> bf16); a unit-stride last dim keeps the row loads contiguous.
    key = key.to(k_cache.dtype)
    value = value.to(v_cache.dtype)
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    store_kv_kernel[(num_rows,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4,
        **pdl_args(key.device),
    )
