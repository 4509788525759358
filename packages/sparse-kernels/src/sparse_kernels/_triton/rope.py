"""Triton ``rope_qk`` and ``rope_store``: one program per (token, head) over the q heads then the k heads.

Each program loads its head's two halves, optionally RMS-normalises the head (Qwen3's q/k norm),
looks its token's angles up in the table and writes the rotated head to a contiguous output. Casts
sit where the reference rounds (see ``sparse_kernels.rope``).

With ``STORE`` (``rope_store``) a k-head program writes its rotated head straight into the paged pool at
its token's slot instead of ``k_out``, and copies the token's v head there too (nothing for slot ``-1``);
with ``COPY`` a q-head program of token ``t < num_copy`` also writes its rotated head to row
``copy_index[t]`` of ``copy_into``: what ``store_kv`` would do after ``rope_qk``, in the same launch.
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
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    copy_into_ptr,
    copy_index_ptr,
    num_copy,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    COPY: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_head = head - NUM_Q_HEADS  # negative for q heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    # Step metadata from the host (read before the wait, like the positions below): the token's pool slot,
    # and for the first num_copy tokens' q heads the row of copy_into they go to. Masks that depend on
    # them compare offs with a limit of HALF or 0 (the interpreter's ``&`` of a vector and a scalar mask
    # yields integers, which it refuses as a mask).
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # A k-head program of a padded token (slot -1) leaves the pool alone: it loads and stores nothing.
        mask = offs < tl.where((head < NUM_Q_HEADS) | (slot >= 0), HALF, 0)
        kv_mask = offs < tl.where((head >= NUM_Q_HEADS) & (slot >= 0), HALF, 0)
        kv_dst = slot * (NUM_KV_HEADS * 2 * HALF) + kv_head * (2 * HALF)  # int64: pools exceed 2**31 elements
    if COPY:
        copies = (head < NUM_Q_HEADS) & (t < num_copy)  # num_copy is 0 when the call copies nothing
        dest = tl.load(copy_index_ptr + t, mask=copies, other=0).to(tl.int64)
        copy_mask = offs < tl.where(copies, HALF, 0)
    if head < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + head * stride_qh
        dst = q_out_ptr + (t * NUM_Q_HEADS + head) * (2 * HALF)
        w_ptr = qw_ptr
    else:
        src = k_ptr + t * stride_kt + kv_head * stride_kh
        if STORE:
            dst = k_cache_ptr + kv_dst
        else:
            dst = k_out_ptr + (t * NUM_KV_HEADS + kv_head) * (2 * HALF)
        w_ptr = kw_ptr
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
    if STORE:
        # The token's v head (same dtype as the pool: a plain copy), loaded before any store: the pool's
        # pointers may alias the inputs' as far as the compiler knows.
        vsrc = v_ptr + t * stride_vt + kv_head * stride_vh
        v1 = tl.load(vsrc + offs, mask=kv_mask)
        v2 = tl.load(vsrc + HALF + offs, mask=kv_mask)
    if HAS_NORM:
        inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(dst + offs, o1.to(dtype), mask=mask)
    tl.store(dst + HALF + offs, o2.to(dtype), mask=mask)
    if STORE:
        tl.store(v_cache_ptr + kv_dst + offs, v1, mask=kv_mask)
        tl.store(v_cache_ptr + kv_dst + HALF + offs, v2, mask=kv_mask)
    if COPY:
        cdst = copy_into_ptr + dest * (NUM_Q_HEADS * 2 * HALF) + head * (2 * HALF)
        tl.store(cdst + offs, o1.to(dtype), mask=copy_mask)
        tl.store(cdst + HALF + offs, o2.to(dtype), mask=copy_mask)
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
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _launch(q, k, positions, cos_sin, q_weight, k_weight, eps, k_out=k_out), k_out


def rope_store_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    copy: tuple[torch.Tensor, torch.Tensor, int] | None,
) -> torch.Tensor:
    """Inputs checked by ``sparse_kernels.rope_store`` (v, the caches and ``copy_into`` in q's dtype).
    ``copy``: ``(copy_into [R, Hq, D], copy_index [>= n], n)`` with ``n > 0``, or None. Returns q_out."""
    if v.stride(2) != 1:
        v = v.contiguous()
    store = (v, k_cache, v_cache, slot_mapping)
    return _launch(q, k, positions, cos_sin, q_weight, k_weight, eps, store=store, copy=copy)


def _launch(q, k, positions, cos_sin, q_weight, k_weight, eps, *, k_out=None, store=None, copy=None) -> torch.Tensor:
    """One launch over ``T x (Hq + Hkv)`` programs; writes ``k_out``, or with ``store`` the pool. Returns q_out."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    v, k_cache, v_cache, slot_mapping = store if store is not None else (k, k_out, k_out, positions)
    copy_into, copy_index, num_copy = copy if copy is not None else (q_out, positions, 0)
    has_norm = q_weight is not None
    half = head_dim // 2
    rope_qk_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q,
        k,
        q_out,
        k_out if k_out is not None else k_cache,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        positions,
        cos_sin,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        copy_into,
        copy_index,
        num_copy,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HAS_NORM=has_norm,
        STORE=store is not None,
        COPY=copy is not None,
        BLOCK=triton.next_power_of_2(half),
        num_warps=1 if half <= 64 else 2,
        **pdl_args(q.device),
    )
    return q_out
