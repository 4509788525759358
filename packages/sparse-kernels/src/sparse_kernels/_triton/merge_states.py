"""Triton ``merge_states_``: a program per ``ROWS_PER_PROGRAM`` query rows (``D`` elements each), written over the
first state or into a third tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _merge_states_kernel(
    out_ptr, lse_ptr, ob_ptr, lseb_ptr, dst_ptr, dim, rows_per_outer, num_rows,
    stride_outer, stride_row, stride_b_outer, stride_b_row, stride_d_outer, stride_d_row,
    stride_l_outer, stride_l_row, stride_lb_outer, stride_lb_row,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < num_rows
    o, i = r // rows_per_outer, r % rows_per_outer
    d = tl.arange(0, BLOCK_D)
    m = live[:, None] & (d < dim)[None, :]
    src = out_ptr + (o * stride_outer + i * stride_row)[:, None] + d[None, :]
    dst = dst_ptr + (o * stride_d_outer + i * stride_d_row)[:, None] + d[None, :]
    la = tl.load(lse_ptr + o * stride_l_outer + i * stride_l_row, mask=live, other=0.0)
    lb = tl.load(lseb_ptr + o * stride_lb_outer + i * stride_lb_row, mask=live, other=0.0)
    top = tl.maximum(la, lb)
    wa = tl.exp(la - top)
    wb = tl.exp(lb - top)
    a = tl.load(src, mask=m, other=0.0).to(tl.float32)
    b = tl.load(ob_ptr + (o * stride_b_outer + i * stride_b_row)[:, None] + d[None, :], mask=m, other=0.0)
    merged = (a * wa[:, None] + b.to(tl.float32) * wb[:, None]) / (wa + wb)[:, None]
    tl.store(dst, merged.to(dst_ptr.dtype.element_ty), mask=m)
    pdl_exit(USE_GDC)


merge_states_kernel = Kernel(_merge_states_kernel)
# A row a program (one warp) merged the cascade prefill's 2048 x 32 rows of 128 in 81 us on an H200 (session 26,
# ~0.5 TB/s); 16 rows in four warps are what a memory-bound elementwise kernel needs.
ROWS_PER_PROGRAM = 16


def _leading(x: torch.Tensor, dims: int) -> torch.Tensor:
    return x if x.dim() == dims else x.unsqueeze(0)


def merge_states_triton(out_a, lse_a, out_b, lse_b, out=None):
    """``out_a``, ``out_b`` ``[R, D]`` or ``[B, R, D]`` (any strides, unit on ``D``; any float dtypes), the LSEs
    ``[R]`` / ``[B, R]`` (any strides); the merge is written into ``out`` (the same shape, unit stride on ``D``;
    default ``out_a``), which is returned."""
    out = out_a if out is None else out
    view, other, dst = _leading(out_a, 3), _leading(out_b, 3), _leading(out, 3)
    if other.stride(-1) != 1:
        other = other.contiguous()
    la, lb = (_leading(x.to(torch.float32), 2) for x in (lse_a, lse_b))
    outer, rows, dim = view.shape
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(ROWS_PER_PROGRAM, 4096 // block_d))
    merge_states_kernel[(triton.cdiv(outer * rows, block_r),)](
        view,
        la,
        other,
        lb,
        dst,
        dim,
        rows,
        outer * rows,
        view.stride(0),
        view.stride(1),
        other.stride(0),
        other.stride(1),
        dst.stride(0),
        dst.stride(1),
        la.stride(0),
        la.stride(1),
        lb.stride(0),
        lb.stride(1),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4 if block_r * block_d >= 1024 else 1,
        **pdl_args(out_a.device),
    )
    return out
