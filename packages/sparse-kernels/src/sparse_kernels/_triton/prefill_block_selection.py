"""Triton FlashPrefill block selection: block means and the fused score + select + compact step.

Same contract as ``sparse_kernels.prefill_block_selection`` (``block_means_reference`` /
``select_blocks``), on the device in two launches and no host work: ``block_means_triton`` reads the
pages straight from the step's CSR (every head of a token in one contiguous row), and
``select_blocks_triton`` runs one program per (query tile, KV head) that scores the tile's active
blocks against its packed query rows, then writes the kept and mean-corrected block lists, ascending.

The tile's mass on block ``j``, ``S[j] = sum_r 2^(s[r, j] - max s)``, is kept as its log2,
``L[j] = c_j + log2 sum_r 2^(s[r, j] - c_j)`` with ``c_j`` the block's own column max: that needs no
tile-wide max, so one pass scores every block (``L`` parked in a scratch row) and a second pass keeps
``j`` where ``2^(L[j] - max L) >= abs_threshold`` and compacts the lists with a prefix sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.block_sparse_prefill import packed_query_tile
from sparse_kernels._triton.launch import Kernel


def _block_mean_kernel(
    k_ptr,
    v_ptr,
    k_mean_ptr,
    v_mean_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_len_ptr,
    max_blocks,
    min_sparse_q_len,
    ROW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    """Grid ``(max_blocks, B, cdiv(ROW, BLOCK_ROW))``: float32 mean of block ``j``'s keys and values over
    ``BLOCK_ROW`` of the ``ROW = num_kv_heads * head_dim`` columns of a token (0 for dense requests)."""
    j = tl.program_id(0)
    b = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    mask_c = offs < ROW
    qo_len = tl.load(qo_indptr_ptr + b + 1) - tl.load(qo_indptr_ptr + b)
    page_lo = tl.load(kv_indptr_ptr + b)
    kv_len = (tl.load(kv_indptr_ptr + b + 1) - page_lo - 1) * BLOCK_SIZE + tl.load(kv_last_len_ptr + b)
    n = tl.minimum(tl.maximum(kv_len - j * K_BLOCK_N, 0), K_BLOCK_N)
    n = tl.where(qo_len > min_sparse_q_len, n, 0)
    k_sum = tl.zeros([BLOCK_ROW], tl.float32)
    v_sum = tl.zeros([BLOCK_ROW], tl.float32)
    for r in range(0, n, ROWS):
        offs_r = r + tl.arange(0, ROWS)
        valid = offs_r < n
        tok = j * K_BLOCK_N + offs_r
        page = tl.load(kv_indices_ptr + page_lo + tok // BLOCK_SIZE, mask=valid, other=0)
        src = (page.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE)[:, None] * ROW + offs[None, :]
        mask = valid[:, None] & mask_c[None, :]
        k_sum += tl.sum(tl.load(k_ptr + src, mask=mask, other=0.0).to(tl.float32), 0)
        v_sum += tl.sum(tl.load(v_ptr + src, mask=mask, other=0.0).to(tl.float32), 0)
    dst = (b.to(tl.int64) * max_blocks + j) * ROW + offs
    count = tl.maximum(n, 1).to(tl.float32)
    tl.store(k_mean_ptr + dst, k_sum / count, mask=mask_c)
    tl.store(v_mean_ptr + dst, v_sum / count, mask=mask_c)


def _select_kernel(
    q_ptr,
    k_mean_ptr,
    mass_ptr,
    keep_ids_ptr,
    keep_counts_ptr,
    mean_ids_ptr,
    mean_counts_ptr,
    tile_req_ptr,
    tile_row_ptr,
    first_k_ptr,
    last_k_ptr,
    active_ptr,
    mean_end_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_last_len_ptr,
    stride_qt,
    stride_qh,
    num_tiles,
    max_blocks,
    scale_log2,
    threshold,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_BLOCK_M: tl.constexpr,
    K_BLOCK_N: tl.constexpr,
    SINK_BLOCKS: tl.constexpr,
    WINDOW_BLOCKS: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid ``(num_tiles, NUM_KV_HEADS)``: the kept / mean-corrected block lists of one tile and KV head."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b, _, _, kv_len, qo_len, _, _, pos, mask_m, offs_d, mask_d, q = packed_query_tile(
        q_ptr, tile_req_ptr, tile_row_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_last_len_ptr, stride_qt, stride_qh,
        tile, h, GROUP, HEAD_DIM, BLOCK_SIZE, K_BLOCK_M, BLOCK_D,
    )  # fmt: skip
    q = q.to(tl.float32)
    active = tl.load(active_ptr + tile)
    lists = (h * num_tiles + tile).to(tl.int64) * max_blocks
    row_pos = kv_len - qo_len + pos

    # Pass 1: log2 mass of each active block (scored by the rows that see its first key).
    best = tl.full([BLOCK_J], float("-inf"), tl.float32)
    for j0 in range(0, active, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mask_j = offs_j < active
        mean_row = ((b * max_blocks + offs_j).to(tl.int64) * NUM_KV_HEADS + h) * HEAD_DIM
        km = tl.load(
            k_mean_ptr + mean_row[None, :] + offs_d[:, None], mask=mask_j[None, :] & mask_d[:, None], other=0.0
        )
        s = tl.dot(q, km, input_precision=PRECISION) * scale_log2  # [K_BLOCK_M, BLOCK_J]
        sees = mask_m[:, None] & mask_j[None, :] & (row_pos[:, None] >= offs_j[None, :] * K_BLOCK_N)
        s = tl.where(sees, s, float("-inf"))
        col = tl.max(s, 0)
        col_safe = tl.where(col == float("-inf"), 0.0, col)
        mass = tl.where(col == float("-inf"), col, col_safe + tl.log2(tl.sum(tl.exp2(s - col_safe[None, :]), 0)))
        tl.store(mass_ptr + lists + offs_j, mass, mask=mask_j)
        best = tl.maximum(best, mass)
    top = tl.max(best, 0)

    # Pass 2: keep scored, sink and local blocks (every visible one in a dense tile); compact ascending.
    first_k = tl.load(first_k_ptr + tile)
    last_k = tl.load(last_k_ptr + tile)
    mean_end = tl.load(mean_end_ptr + tile)
    local_lo = tl.where(active == 0, 0, first_k - WINDOW_BLOCKS + 1)  # a dense tile (none active) keeps all
    n_keep = 0
    n_mean = 0
    for j0 in range(0, last_k + 1, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        visible = offs_j <= last_k
        scored = offs_j < active
        mass = tl.load(mass_ptr + lists + offs_j, mask=scored, other=float("-inf"))
        scored = scored & (tl.exp2(mass - top) >= threshold)
        keep = visible & (scored | (offs_j < SINK_BLOCKS) | (offs_j >= local_lo))
        mean = visible & ~keep & (offs_j < mean_end)
        flag = keep.to(tl.int32)
        tl.store(keep_ids_ptr + lists + n_keep + tl.cumsum(flag, 0) - flag, offs_j, mask=keep)
        n_keep += tl.sum(flag, 0)
        flag = mean.to(tl.int32)
        tl.store(mean_ids_ptr + lists + n_mean + tl.cumsum(flag, 0) - flag, offs_j, mask=mean)
        n_mean += tl.sum(flag, 0)
    tl.store(keep_counts_ptr + h * num_tiles + tile, n_keep)
    tl.store(mean_counts_ptr + h * num_tiles + tile, n_mean)


block_mean_kernel = Kernel(_block_mean_kernel)
select_kernel = Kernel(_select_kernel)

# Scores are fp32 dots of the queries with the block means: tf32 tensor cores on the GPU (a whole 128K
# prompt scores ~0.5 TFLOP; the means' rounding to tf32 moves a logit by ~1e-3 of itself), IEEE on CPU.
SELECT_CONFIG = {"BLOCK_J": 64, "num_warps": 8, "num_stages": 2}
# Columns per block-mean program (a token's K row of every head is contiguous) and rows per load.
MEAN_CONFIG = {"BLOCK_ROW": 1024, "ROWS": 16, "num_warps": 8}


def block_means_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, plan, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[B, max_blocks, Hkv, D]`` mean keys and values of each sparse request's blocks (0 elsewhere)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    batch, row = len(layout.qo_lens), num_kv_heads * head_dim
    k_mean = torch.empty(batch, layout.max_blocks, num_kv_heads, head_dim, dtype=torch.float32, device=k_cache.device)
    v_mean = torch.empty_like(k_mean)
    block_row = min(MEAN_CONFIG["BLOCK_ROW"], triton.next_power_of_2(row))
    block_mean_kernel[(layout.max_blocks, batch, triton.cdiv(row, block_row))](
        k_cache,
        v_cache,
        k_mean,
        v_mean,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_len,
        layout.max_blocks,
        layout.params.min_sparse_q_len,
        ROW=row,
        BLOCK_SIZE=block_size,
        K_BLOCK_N=layout.params.k_block_n,
        ROWS=MEAN_CONFIG["ROWS"],
        BLOCK_ROW=block_row,
        num_warps=MEAN_CONFIG["num_warps"],
    )
    return k_mean, v_mean


def select_blocks_triton(q: torch.Tensor, k_mean: torch.Tensor, plan, layout):
    """``select_blocks`` in one launch: a ``BlockLists`` (ids past each count are unspecified)."""
    from sparse_kernels.prefill_block_selection import BlockLists

    if q.stride(2) != 1:
        q = q.contiguous()
    p, dev, shape = layout.params, q.device, (layout.num_kv_heads, layout.num_tiles)
    keep_ids = torch.empty(*shape, layout.max_blocks, dtype=torch.int32, device=dev)
    mean_ids = torch.empty_like(keep_ids)
    keep_counts = torch.empty(shape, dtype=torch.int32, device=dev)
    mean_counts = torch.empty_like(keep_counts)
    mass = torch.empty(keep_ids.shape, dtype=torch.float32, device=dev)  # scratch: log2 mass per block
    select_kernel[(layout.num_tiles, layout.num_kv_heads)](
        q,
        k_mean,
        mass,
        keep_ids,
        keep_counts,
        mean_ids,
        mean_counts,
        layout.tile_req,
        layout.tile_row,
        layout.first_k,
        layout.last_k,
        layout.active,
        layout.mean_end,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_last_len,
        q.stride(0),
        q.stride(1),
        layout.num_tiles,
        layout.max_blocks,
        plan.sm_scale * 1.4426950408889634,  # log2(e): scores in log2 units
        p.abs_threshold,
        NUM_KV_HEADS=layout.num_kv_heads,
        GROUP=layout.group,
        HEAD_DIM=layout.head_dim,
        BLOCK_SIZE=plan.block_size,
        K_BLOCK_M=p.k_block_m,
        K_BLOCK_N=p.k_block_n,
        SINK_BLOCKS=p.attention_sink_blocks,
        WINDOW_BLOCKS=p.window_blocks,
        BLOCK_D=max(16, triton.next_power_of_2(layout.head_dim)),
        PRECISION="ieee" if dev.type == "cpu" else "tf32",
        **SELECT_CONFIG,
    )
    return BlockLists(keep_ids, keep_counts, mean_ids, mean_counts)
