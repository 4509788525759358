"""Triton ``rope_qk``: one program per (token, head) over the q heads then the k heads.

Each program loads its head's two halves, optionally RMS-normalises the head (Qwen3's q/k norm),
looks its token's angles up in the table and writes the rotated head to a contiguous output. Casts
sit where the reference rounds (see ``sparse_kernels.rope``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + head * stride_qh
        dst = q_out_ptr + (t * NUM_Q_HEADS + head) * (2 * HALF)
        w_ptr = qw_ptr
    else:
        src = k_ptr + t * stride_kt + (head - NUM_Q_HEADS) * stride_kh
        dst = k_out_ptr + (t * NUM_KV_HEADS + head - NUM_Q_HEADS) * (2 * HALF)
        w_ptr = kw_ptr
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    dtype = src.dtype.element_ty
    # Positions (step metadata from the host), the angle table and the norm weights are read before
    # waiting for the kernel that wrote q and k.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    if HAS_NORM:
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(USE_GDC)
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(dst + offs, o1.to(dtype), mask=mask)
    tl.store(dst + HALF + offs, o2.to(dtype), mask=mask)
    pdl_exit(USE_GDC)


rope_qk_kernel = Kernel(_rope_qk_kernel)


def rope_qk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs checked by ``sparse_kernels.rope_qk``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    has_norm = q_weight is not None
    half = head_dim // 2
    rope_qk_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q,
        k,
        q_out,
        k_out,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        positions,
        cos_sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin.stride(0),
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HAS_NORM=has_norm,
        BLOCK=triton.next_power_of_2(half),
        num_warps=1 if half <= 64 else 2,
        **pdl_args(q.device),
    )
    return q_out, k_out
