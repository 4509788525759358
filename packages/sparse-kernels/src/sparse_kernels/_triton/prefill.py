"""Triton paged prefill over a cached prefix: varlen queries, causal mask aligned to each KV end, GQA.

Grid ``(num_q_tiles, num_qo_heads)``. ``plan`` cuts every request's queries into tiles of ``BLOCK_M``
rows and lists each tile's request and first row, so the kernel needs no search. Query ``i`` of a
request with ``qo_len`` queries and ``kv_len`` keys sits at position ``kv_len - qo_len + i``; a tile
stops reading keys after its last query's position when causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args


def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tile_req_ptr,
    tile_row_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_len_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    scale_log2,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GROUP
    b = tl.load(tile_req_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    qo_lo = tl.load(qo_indptr_ptr + b)
    qo_len = tl.load(qo_indptr_ptr + b + 1) - qo_lo
    page_lo = tl.load(kv_indptr_ptr + b)
    kv_len = (tl.load(kv_indptr_ptr + b + 1) - page_lo - 1) * BLOCK_SIZE + tl.load(kv_last_len_ptr + b)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < qo_len
    mask_d = offs_d < HEAD_DIM
    rows = (qo_lo + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    q_pos = kv_len - qo_len + offs_m  # padded rows sit past the end: they see every key, harmlessly
    if CAUSAL:
        hi = tl.minimum(kv_len, kv_len - qo_len + row0 + BLOCK_M)
    else:
        hi = kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        block = tl.load(kv_indices_ptr + page_lo + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_row = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM
        # K is read transposed, [BLOCK_D, BLOCK_N], so the dot needs no transpose.
        k = tl.load(k_ptr + kv_row[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        keep = mask_n[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_row[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new
    tl.store(
        out_ptr + rows[:, None] * stride_ot + hq * stride_oh + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


prefill_kernel = Kernel(_prefill_kernel)

# Tile sizes; the GPU defaults suit head_dim 64-128 in bf16 (fp32 runs IEEE dots at the same tiles).
PREFILL_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@dataclass(frozen=True, slots=True)
class TritonPrefillPlan:
    """Device tensors of one prefill step (all int32) and the layout ``run`` checks against."""

    tile_req: torch.Tensor  # [num_tiles]: request of each query tile
    tile_row: torch.Tensor  # [num_tiles]: first query row of the tile within its request
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_len: torch.Tensor
    num_qo_tokens: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    causal: bool
    sm_scale: float


def query_tiles(qo_lens: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``(tile_req, tile_row)`` covering every request's ``qo_len`` rows in ``block_m`` steps."""
    tiles_per_req = (qo_lens + block_m - 1) // block_m
    tile_req = torch.repeat_interleave(torch.arange(qo_lens.numel()), tiles_per_req)
    first = torch.cumsum(tiles_per_req, 0) - tiles_per_req
    tile_row = (torch.arange(tile_req.numel()) - first[tile_req]) * block_m
    return tile_req.to(torch.int32), tile_row.to(torch.int32)


def run_prefill_triton(plan: TritonPrefillPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out):
    """Launch over the plan; ``q``/``out`` rows may be strided, the last dim must be unit-stride."""
    q = q.to(k_cache.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    group = plan.num_qo_heads // plan.num_kv_heads
    prefill_kernel[(plan.tile_req.numel(), plan.num_qo_heads)](
        q,
        k_cache,
        v_cache,
        out,
        plan.tile_req,
        plan.tile_row,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_len,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        plan.sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        NUM_KV_HEADS=plan.num_kv_heads,
        GROUP=group,
        HEAD_DIM=plan.head_dim,
        BLOCK_SIZE=plan.block_size,
        CAUSAL=plan.causal,
        BLOCK_D=max(16, triton.next_power_of_2(plan.head_dim)),
        **dot_args(k_cache.dtype, k_cache.device),
        **PREFILL_CONFIG,
    )
    return out
