"""Triton ``rms_norm`` / ``fused_add_rms_norm``: one program per row, the whole row in registers.

Rows are hidden states (a few thousand elements), so one block covers a row and the sum of squares is
a single in-register reduction. Casts sit where the reference rounds (see ``sparse_kernels.rms_norm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    stride_x,
    stride_r,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like a separate add
        tl.store(h_ptr + row * n_cols + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * inv_rms).to(x.dtype).to(tl.float32)  # cast back before the weight, as HF does
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)
    pdl_exit(USE_GDC)


rms_norm_kernel = Kernel(_rms_norm_kernel)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inputs checked by ``sparse_kernels.rms_norm``; returns ``(normed, x + residual or None)``."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    block = triton.next_power_of_2(n_cols)
    rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        h if h is not None else out,
        x2.stride(0),
        r2.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
        **pdl_args(x.device),
    )
    return out, h


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A ``[rows, N]`` view with a unit-stride last dim (a copy only when no such view exists)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()
