"""Triton ``silu_and_mul``: a 2-D grid of (row, column block); each program reads its gate and up
columns and writes the product (casts where the reference rounds, see ``sparse_kernels.silu_mul``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

BLOCK = 1024


def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n_cols, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    pdl_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)
    pdl_exit(USE_GDC)


silu_and_mul_kernel = Kernel(_silu_and_mul_kernel)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Inputs checked by ``sparse_kernels.silu_and_mul``."""
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], n_cols, dtype=x.dtype, device=x.device)
    block = min(BLOCK, triton.next_power_of_2(n_cols))
    silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, block))](
        x2, out, x2.stride(0), n_cols, BLOCK=block, num_warps=4, **pdl_args(x.device)
    )
    return out
