"""Triton ``store_kv``: one program per new row; rows with slot ``-1`` skip the pool. Program ``i <
n_copy`` also copies row ``i`` of ``copy_rows`` (all its heads) to row ``copy_index[i]`` of ``copy_into``."""

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
    copy_rows_ptr,
    copy_into_ptr,
    copy_index_ptr,
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
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(value_ptr + row * stride_vn + head * stride_vh + dim, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)
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
) -> None:
    """Inputs already validated by ``sparse_kernels.store_kv``; any row/head strides are read in place.
    ``copy``: ``(rows [n, H, D], into [R, H, D], index [>= n])`` (see ``store_kv``), or None."""
    num_rows, num_kv_heads, head_dim = key.shape
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
        rows.shape[0] if copy is not None else 0,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        rows.stride(0),
        rows.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        COPY_HEADS=copy_heads,
        COPY_BLOCK=triton.next_power_of_2(max(copy_heads, 1) * head_dim),
        num_warps=4,
        **pdl_args(key.device),
    )
