"""Triton ``top_k_ascending``: one program per row; the k-th largest bit by bit, then a prefix sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel


def _top_k_ascending_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    n,
    k,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    # Ordered keys: non-negative floats keep their bits, negative ones flip the magnitude bits, so
    # integer order is float order; -0.0 maps to 0.0's key.
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    # The largest t with count(key >= t) >= k is the k-th largest key: its sign first, then its other
    # 31 bits from the top (within one sign, int32 order is the order of those bits). int32 only.
    nonneg = tl.sum(((key >= 0) & valid).to(tl.int32), axis=0)
    t = tl.where(nonneg >= k, 0, -2147483648)
    for i in range(31):
        cand = t | (1 << (30 - i))
        count = tl.sum(((key >= cand) & valid).to(tl.int32), axis=0)
        t = tl.where(count >= k, cand, t)
    above = (key > t) & valid
    at = (key == t) & valid
    need = k - tl.sum(above.to(tl.int32), axis=0)
    chosen = above | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * k + pos, offs.to(tl.int64), mask=chosen)


top_k_ascending_kernel = Kernel(_top_k_ascending_kernel)


def top_k_ascending_triton(scores: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """``scores`` [R, N] (unit stride along N), ``out`` [R, k] contiguous int64; validated by the caller."""
    rows, n = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    block = max(16, triton.next_power_of_2(n))
    top_k_ascending_kernel[(rows,)](
        scores, out, scores.stride(0), n, k, BLOCK=block, num_warps=max(4, min(16, block // 1024))
    )
    return out
