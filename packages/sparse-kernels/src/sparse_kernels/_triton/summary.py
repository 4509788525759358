"""Triton ``block_summary``: one program per (listed block, KV head) reduces the block's valid keys (and,
with a scale, writes them as ``summary_codes``' outward-rounded int8 codes). With ``token_scale`` the cache
holds fp8 codes and a float32 scale per (token, KV head): the keys are dequantized first (an fp8 store)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit


def _block_summary_kernel(
    k_ptr,
    token_scale_ptr,
    ids_ptr,
    valid_ptr,
    kmin_ptr,
    kmax_ptr,
    scale_ptr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    TOKEN_SCALE: tl.constexpr,
    FROM_SLOTS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    i = tl.program_id(0)
    h = tl.program_id(1)
    if FROM_SLOTS:  # ids are a decode step's slots: the block through the written token (-1: a padding row)
        written = tl.load(ids_ptr + i).to(tl.int64)
        block = tl.maximum(written, 0) // BLOCK_SIZE
        n = tl.where(written >= 0, written % BLOCK_SIZE + 1, 0)
    else:
        block = tl.load(ids_ptr + i).to(tl.int64)
        n = tl.load(valid_ptr + i).to(tl.int64)
    if n > 0:
        offs_t = tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_t[:, None] < n) & (offs_d[None, :] < HEAD_DIM)
        slot = block * BLOCK_SIZE + offs_t
        k = tl.load(k_ptr + (slot[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
        k = k.to(tl.float32)
        if TOKEN_SCALE:  # fp8 codes times their (token, head) scale: the keys attention reads
            k = k * tl.load(token_scale_ptr + slot * NUM_KV_HEADS + h, mask=offs_t < n, other=0.0)[:, None]
        k_min = tl.min(tl.where(mask, k, float("inf")), 0)
        k_max = tl.max(tl.where(mask, k, float("-inf")), 0)
        dst = (block * NUM_KV_HEADS + h) * HEAD_DIM + offs_d
        mask_d = offs_d < HEAD_DIM
        if HAS_SCALE:  # one head: a one-row encode
            head = scale_ptr + block * NUM_KV_HEADS + h + tl.zeros([1], tl.int64)
            k_min, k_max = encode_codes(k_min[None, :], k_max[None, :], mask_d[None, :], head)
            k_min, k_max = tl.reshape(k_min, (BLOCK_D,)), tl.reshape(k_max, (BLOCK_D,))
        # Min and max are existing key values, so narrowing back to the cache dtype is exact.
        tl.store(kmin_ptr + dst, k_min.to(kmin_ptr.dtype.element_ty), mask=mask_d)
        tl.store(kmax_ptr + dst, k_max.to(kmax_ptr.dtype.element_ty), mask=mask_d)
    pdl_exit(USE_GDC)


@triton.jit
def encode_codes(lo, hi, mask, scale_ptrs):
    """``summary_codes.encode_summary`` of float32 ``lo`` / ``hi`` ``[R, D]``, one KV head a row (``mask``: the
    valid channels): stores each row's scale at ``scale_ptrs`` ``[R]`` and returns the outward-rounded codes (as
    float32 integers in [-127, 127]). ``block_summary``'s programs encode one head, the fused store a row's."""
    amax = tl.max(tl.where(mask, tl.maximum(tl.abs(lo), tl.abs(hi)), 0.0), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    tl.store(scale_ptrs, scale)
    lo = tl.minimum(tl.maximum(tl.math.floor(tl.math.div_rn(lo, scale[:, None])), -127.0), 127.0)
    hi = tl.minimum(tl.maximum(tl.math.ceil(tl.math.div_rn(hi, scale[:, None])), -127.0), 127.0)
    return lo, hi


block_summary_kernel = Kernel(_block_summary_kernel)


def block_summary_triton(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_valid: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    scale: torch.Tensor | None = None,
    from_slots: bool = False,
    token_scale: torch.Tensor | None = None,
) -> None:
    """Inputs already validated by ``sparse_kernels.block_summary`` (``from_slots``: ``block_ids`` is a
    decode step's slot mapping, ``num_valid`` unused; ``update_block_summaries``). ``token_scale``: float32
    ``[num_blocks, block_size, num_kv_heads]`` of an fp8 cache (``quantized_block_summary``)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_summary_kernel[(block_ids.numel(), num_kv_heads)](
        k_cache,
        k_cache if token_scale is None else token_scale,
        block_ids,
        num_valid,
        kmin,
        kmax,
        kmin if scale is None else scale,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=max(2, triton.next_power_of_2(block_size)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_SCALE=scale is not None,
        TOKEN_SCALE=token_scale is not None,
        FROM_SLOTS=from_slots,
        num_warps=2,
        **pdl_args(k_cache.device),
    )
