"""Triton small-M linear (decode GEMV): ``out = x W^T (+ b)`` for a few rows of ``x``.

At decode a projection multiplies 1-16 token rows by a weight of tens of megabytes, so the step is a
pure weight read. Program ``n`` owns ``BLOCK_N`` output columns (weight rows, contiguous along K),
streams them once in ``BLOCK_K`` tiles and keeps every row of ``x`` in registers. No split-K: the
grid is ``cdiv(N, BLOCK_N)`` programs and one launch writes the result (cuBLAS's small-M kernels add a
separate split-K reduce per call).

``USE_DOT`` picks ``tl.dot`` on a ``BLOCK_M >= 16`` tile (rows past M masked; tensor cores are idle
anyway), else a broadcast multiply and a sum over K in fp32 (``BLOCK_M`` up to a few rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _small_m_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]: int64, large vocab heads
    x_rows = x_ptr + offs_m * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(x_rows[:, None] + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if USE_DOT:
            w = tl.load(w_rows[None, :] + k[:, None], mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)  # [BLOCK_K, BLOCK_N]
        else:
            w = tl.load(w_rows[:, None] + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
            acc += tl.sum(prod, 2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    pdl_exit(USE_GDC)


small_m_linear_kernel = Kernel(_small_m_linear_kernel)


def small_m_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict
) -> torch.Tensor:
    """Inputs checked by ``sparse_kernels.linear``; ``x`` is 2-D with unit stride on K.

    ``config``: ``USE_DOT``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` (``BLOCK_M`` is
    derived from M: the next power of two, at least 16 for ``tl.dot``).
    """
    from sparse_kernels._triton.launch import dot_args

    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    use_dot = bool(config["USE_DOT"])
    block_m = max(16 if use_dot else 1, triton.next_power_of_2(m))
    small_m_linear_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        USE_DOT=use_dot,
        BLOCK_M=block_m,
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        **dot_args(weight.dtype, weight.device),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **pdl_args(x.device),
    )
    return out
