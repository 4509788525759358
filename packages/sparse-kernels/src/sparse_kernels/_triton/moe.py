"""Triton grouped GEMM over single-expert tiles (``sparse_kernels.moe_align``), the two halves of a
fused MoE layer in one kernel source.

Program ``(tile, n)`` reads its tile's expert id; tiles past the last expert's run (id ``E``) exit at
once, so only the routed experts' weights are ever read. It gathers its ``BLOCK_M`` entries' input
rows and streams ``BLOCK_N`` rows of that expert's weight (``[N, K]``, K contiguous) in ``BLOCK_K``
tiles through ``tl.dot``, fp32 accumulation.

- ``GATED`` (gate/up): the weight holds gate rows ``[0, N)`` and up rows ``[N, 2N)``; two accumulators,
  and the epilogue writes ``silu(gate) * up`` (rounded where ``silu_and_mul`` rounds). Entry ``i``
  reads input row ``i // top_k`` (its token).
- otherwise (down): entry ``i`` reads input row ``i`` (its activation) and the epilogue writes
  ``round(round(acc) * topk_weight[i])``, the entry's weighted contribution; the caller sums the
  ``top_k`` contributions of a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args, pdl_args, pdl_enter, pdl_exit
from sparse_kernels.moe_align import ExpertTiles


def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    tile_experts_ptr,
    topk_weights_ptr,
    num_entries,
    a_row_div,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    NUM_EXPERTS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    tile = tl.program_id(0)
    pdl_enter(USE_GDC)  # everything but the weights is written by this step's router and align step
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= NUM_EXPERTS:  # padding of the grid: no entries, no weight reads
        pdl_exit(USE_GDC)
        return
    rows = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # entry ids
    valid = rows < num_entries
    a_rows = a_ptr + (rows // a_row_div).to(tl.int64) * stride_am
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = (k < K) | EVEN_K  # whole K tiles: the K mask folds away
        a = tl.load(a_rows[:, None] + k[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = mask_n[None, :] & mask_k[:, None]
        w = tl.load(w_rows[None, :] + k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w.to(DOT_DTYPE), input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_rows[None, :] + N * stride_wn + k[:, None], mask=w_mask, other=0.0)
            acc_up += tl.dot(a, w_up.to(DOT_DTYPE), input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)  # the projection's output, rounded as F.linear rounds it
    if GATED:
        act = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)
        y = act * acc_up.to(dtype).to(tl.float32)
    else:
        y = y * tl.load(topk_weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, y.to(dtype), mask=valid[:, None] & mask_n[None, :])
    pdl_exit(USE_GDC)


moe_gemm_kernel = Kernel(_moe_gemm_kernel)


def moe_gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    tiles: ExpertTiles,
    *,
    gated: bool,
    a_row_div: int,
    topk_weights: torch.Tensor | None,
    config: dict,
) -> torch.Tensor:
    """One grouped GEMM: ``[num_entries, N]`` in ``a.dtype`` (rows of entries no tile names unwritten).

    ``a`` ``[rows, K]`` with unit stride on K; ``w`` ``[E, N or 2N, K]`` with unit stride on K;
    ``topk_weights`` fp32 ``[num_entries]`` (down only); ``config``: this GEMM's ``BLOCK_N``,
    ``BLOCK_K``, ``num_warps``, ``num_stages`` (``BLOCK_M`` is the tiles').
    Grid: ``(tiles, N / BLOCK_N)``, so a step of ``n`` routed experts runs ``n * N / BLOCK_N`` working
    programs, and programs of an expert's consecutive tiles are launched together (its weights come
    from L2 the second time).
    """
    n = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.empty(tiles.num_entries, n, dtype=a.dtype, device=a.device)
    grid = (tiles.num_tiles, triton.cdiv(n, config["BLOCK_N"]))
    moe_gemm_kernel[grid](
        a,
        w,
        out,
        tiles.sorted_ids,
        tiles.tile_experts,
        topk_weights if topk_weights is not None else a,
        tiles.num_entries,
        a_row_div,
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        NUM_EXPERTS=tiles.num_experts,
        GATED=gated,
        BLOCK_M=tiles.block_m,
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        EVEN_K=a.shape[1] % config["BLOCK_K"] == 0,
        **dot_args(w.dtype, w.device),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **pdl_args(a.device),
    )
    return out
