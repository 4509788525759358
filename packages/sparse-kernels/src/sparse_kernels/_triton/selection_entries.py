"""Triton ``selection_entries``: one program per (row, head, tile of entries)."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _selection_entries_kernel(
    chosen_ptr,
    table_ptr,
    start_ptr,
    lens_ptr,
    out_ptr,
    stride_cb,
    stride_ch,
    stride_cs,
    num_heads,
    size,
    BLOCK_SIZE: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the entries are the step's previous kernel's output
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    start = tl.load(start_ptr + b).to(tl.int64)
    kv_len = tl.load(lens_ptr + b).to(tl.int64)
    c = tl.load(chosen_ptr + b.to(tl.int64) * stride_cb + h * stride_ch + offs * stride_cs, mask=mask, other=0)
    c = c.to(tl.int64)
    if SLOTS:
        tok = tl.minimum(c, kv_len - 1)
        block = tl.load(table_ptr + start + tok // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
        ids = block * BLOCK_SIZE + tok % BLOCK_SIZE
    else:
        page = tl.minimum(c, (kv_len + BLOCK_SIZE - 1) // BLOCK_SIZE - 1)
        ids = tl.load(table_ptr + start + page, mask=mask, other=0).to(tl.int64)
    row = (b.to(tl.int64) * num_heads + h) * size
    tl.store(out_ptr + row + offs, ids.to(tl.int32), mask=mask)
    pdl_exit(USE_GDC)


selection_entries_kernel = Kernel(_selection_entries_kernel)


def selection_entries_triton(chosen, table_indices, table_start, kv_lens, out, block_size: int, page_size: int):
    """Inputs validated by ``sparse_kernels.selection_entries``."""
    batch, num_heads, size = chosen.shape
    block = min(1024, max(16, triton.next_power_of_2(size)))
    selection_entries_kernel[(batch, num_heads, triton.cdiv(size, block))](
        chosen,
        table_indices,
        table_start,
        kv_lens,
        out,
        chosen.stride(0),
        chosen.stride(1),
        chosen.stride(2),
        num_heads,
        size,
        BLOCK_SIZE=block_size,
        SLOTS=page_size == 1,
        BLOCK=block,
        num_warps=4,
        **pdl_args(chosen.device),
    )
    return out
