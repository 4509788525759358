"""Triton ``merge_states_``: one program per query row (``D`` elements), in place on the first state."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _merge_states_kernel(
    out_ptr, lse_ptr, ob_ptr, lseb_ptr, dim, rows_per_outer, stride_outer, stride_row, BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < dim
    dst = out_ptr + (r // rows_per_outer) * stride_outer + (r % rows_per_outer) * stride_row + d
    la = tl.load(lse_ptr + r)
    lb = tl.load(lseb_ptr + r)
    top = tl.maximum(la, lb)
    wa = tl.exp(la - top)
    wb = tl.exp(lb - top)
    a = tl.load(dst, mask=m, other=0.0).to(tl.float32)
    b = tl.load(ob_ptr + r * dim + d, mask=m, other=0.0)
    tl.store(dst, ((a * wa + b * wb) / (wa + wb)).to(out_ptr.dtype.element_ty), mask=m)
    pdl_exit(USE_GDC)


merge_states_kernel = Kernel(_merge_states_kernel)


def merge_states_triton(out_a, lse_a, out_b, lse_b):
    """``out_a`` ``[R, D]`` or ``[B, R, D]`` (any strides but unit on ``D``)."""
    view = out_a if out_a.dim() == 3 else out_a.unsqueeze(0)
    outer, rows, dim = view.shape
    merge_states_kernel[(outer * rows,)](
        view,
        lse_a.contiguous(),
        out_b.to(torch.float32).contiguous(),
        lse_b.to(torch.float32).contiguous(),
        dim,
        rows,
        view.stride(0),
        view.stride(1),
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=1,
        **pdl_args(out_a.device),
    )
    return out_a
