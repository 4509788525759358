"""Triton ``window_probs``: a log-sum-exp pass and a probability pass over each row's paged keys.

Both passes give a program one (row, KV head, tile of the group's query heads) and a contiguous
chunk of the row's tokens. Its queries form one ``[G_TILE * N_TILE, D]`` tile (row ``gi * N_TILE + j``
is window query ``j`` of the tile's head ``gi``), scored against ``[D, BLOCK_T]`` key tiles read
through the table with one tensor-core dot (Qwen3, g = 4 and n = 32: a 128-row tile).

1. ``_window_lse_kernel``: per query row, the running max and sum of ``exp2`` over the keys of the
   chunk that row sees (causal), written per chunk (split-K over tokens, so few rows still fill the GPU).
2. ``_window_probs_kernel``: merges the chunks' partials into each row's log-sum-exp, recomputes the
   logits of the tokens before the window, ``exp2(logit - lse)``, sums the ``N_TILE`` rows of each
   head (a reshape) and stores ``[G_TILE, BLOCK_T]`` means; the chunk's tiles past the window's
   start store 0 in a second loop.
Grids depend only on static sizes (batch, heads, table width), so both passes can run in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args, pdl_args, pdl_enter, pdl_exit
from sparse_kernels._triton.stream_split import items_per_program

LOG2_E = 1.4426950408889634
MAX_WINDOW = 128  # window queries one tile holds (larger windows take the reference path)
# Tokens per loop step, launch shape, and the fewest / most loop steps a program's chunk spans: the
# split of each row's tokens over programs, for about ``stream_split.TARGET_PROGRAMS`` of them (a few
# rows still fill the GPU; each program loads its query tile once, so not too short a chunk).
# Untuned defaults: benchmarks/window_scores_probe.py sweeps these on a GPU.
CONFIG = {"BLOCK_T": 64, "num_warps": 8, "num_stages": 2, "min_tiles": 4, "max_tiles": 32}


@triton.jit
def _window_rows(
    q_ptr, n, stride_qb, stride_qn, stride_qh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_TILES: tl.constexpr, G_TILE: tl.constexpr,
    N_TILE: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The program's row ``b``, KV head ``h`` and query rows: ``(b, h, q [G_TILE * N_TILE, BLOCK_D],
    head [R], query [R], valid [R])`` (axis 1 of the grid enumerates (KV head, tile of its heads))."""
    b = tl.program_id(0)
    h = tl.program_id(1) // HEAD_TILES
    offs_r = tl.arange(0, G_TILE * N_TILE)
    offs_d = tl.arange(0, BLOCK_D)
    gi = (tl.program_id(1) % HEAD_TILES) * G_TILE + offs_r // N_TILE
    j = offs_r % N_TILE
    valid = (gi < GROUP) & (j < n)
    head = h * GROUP + gi
    ptrs = q_ptr + b.to(tl.int64) * stride_qb + j * stride_qn + head * stride_qh
    q = tl.load(ptrs[:, None] + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return b, h, q.to(DOT_DTYPE), head, j, valid


@triton.jit
def _key_tile(
    k_ptr, table_row, h, tok, valid,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """KV head ``h``'s keys of tokens ``tok`` through the row's table, transposed: ``[BLOCK_D, BLOCK_T]``."""
    offs_d = tl.arange(0, BLOCK_D)
    block = tl.load(table_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + tok % BLOCK_SIZE
    ptrs = k_ptr + (slot[None, :] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[:, None]
    return tl.load(ptrs, mask=valid[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0).to(DOT_DTYPE)


def _window_lse_kernel(
    q_ptr, k_ptr, table_ptr, lens_ptr, m_part_ptr, s_part_ptr,
    stride_qb, stride_qn, stride_qh, stride_tb, n, chunk, scale_log2,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_TILES: tl.constexpr, G_TILE: tl.constexpr, N_TILE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the queries come from the step's earlier kernels
    b, h, q, head, j, valid = _window_rows(
        q_ptr, n, stride_qb, stride_qn, stride_qh, GROUP, HEAD_DIM, HEAD_TILES, G_TILE, N_TILE, BLOCK_D, DOT_DTYPE
    )
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    split = tl.program_id(2)
    last_seen = kv_len - n + j  # [R]: the last slot each window query sees
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    m = tl.full([G_TILE * N_TILE], float("-inf"), tl.float32)
    s = tl.zeros([G_TILE * N_TILE], tl.float32)
    lo = split * chunk
    for t0 in range(lo, tl.minimum(lo + chunk, kv_len), BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        k = _key_tile(k_ptr, table_row, h, tok, tok < kv_len, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, DOT_DTYPE)
        x = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [R, BLOCK_T]
        x = tl.where(tok[None, :] <= last_seen[:, None], x, float("-inf"))  # also masks tok >= kv_len
        m_new = tl.maximum(m, tl.max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet stays at 0 / -inf
        s = s * tl.exp2(m - m_use) + tl.sum(tl.exp2(x - m_use[:, None]), 1)
        m = m_new
    part = ((split * tl.num_programs(0) + b).to(tl.int64) * NUM_KV_HEADS * GROUP + head) * n + j
    tl.store(m_part_ptr + part, m, mask=valid)
    tl.store(s_part_ptr + part, s, mask=valid)
    pdl_exit(USE_GDC)


def _window_probs_kernel(
    q_ptr, k_ptr, table_ptr, lens_ptr, m_part_ptr, s_part_ptr, out_ptr,
    stride_qb, stride_qn, stride_qh, stride_tb, n, num_splits, chunk, width, scale_log2,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_TILES: tl.constexpr, G_TILE: tl.constexpr, N_TILE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the partials come from the log-sum-exp pass
    b, h, q, head, j, valid = _window_rows(
        q_ptr, n, stride_qb, stride_qn, stride_qh, GROUP, HEAD_DIM, HEAD_TILES, G_TILE, N_TILE, BLOCK_D, DOT_DTYPE
    )
    kv_len = tl.load(lens_ptr + b).to(tl.int32)
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, width)
    # Merge the chunks' (max, sum) into each row's log2-sum-exp2.
    row = (b.to(tl.int64) * NUM_KV_HEADS * GROUP + head) * n + j
    stride_split = tl.num_programs(0).to(tl.int64) * NUM_KV_HEADS * GROUP * n
    m = tl.full([G_TILE * N_TILE], float("-inf"), tl.float32)
    for split in range(num_splits):
        m = tl.maximum(m, tl.load(m_part_ptr + split * stride_split + row, mask=valid, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    s = tl.zeros([G_TILE * N_TILE], tl.float32)
    for split in range(num_splits):
        m_i = tl.load(m_part_ptr + split * stride_split + row, mask=valid, other=float("-inf"))
        s += tl.load(s_part_ptr + split * stride_split + row, mask=valid, other=0.0) * tl.exp2(m_i - m_use)
    lse = m_use + tl.log2(tl.where(valid, s, 1.0))

    scored = kv_len - n  # tokens before the window: every window query sees them
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    gi = (tl.program_id(1) % HEAD_TILES) * G_TILE + tl.arange(0, G_TILE)  # the tile's heads in the group
    out_rows = out_ptr + (b.to(tl.int64) * NUM_KV_HEADS * GROUP + h * GROUP + gi) * width  # [G_TILE]
    store_mask = gi[:, None] < GROUP
    computed_hi = tl.minimum(hi, scored)
    for t0 in range(lo, computed_hi, BLOCK_T):  # tiles with scored tokens (no branch: the loop pipelines)
        tok = t0 + tl.arange(0, BLOCK_T)
        in_row = tok < scored
        k = _key_tile(k_ptr, table_row, h, tok, in_row, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, DOT_DTYPE)
        x = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [R, BLOCK_T]
        p = tl.where(valid[:, None] & in_row[None, :], tl.exp2(x - lse[:, None]), 0.0)
        probs = tl.sum(tl.reshape(p, [G_TILE, N_TILE, BLOCK_T]), 1) / n  # mean over the window
        tl.store(out_rows[:, None] + tok[None, :], probs, mask=store_mask & (tok[None, :] < hi))
    zeros = tl.zeros([G_TILE, BLOCK_T], tl.float32)
    for t0 in range(lo + tl.cdiv(tl.maximum(computed_hi - lo, 0), BLOCK_T) * BLOCK_T, hi, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        tl.store(out_rows[:, None] + tok[None, :], zeros, mask=store_mask & (tok[None, :] < hi))
    pdl_exit(USE_GDC)


window_lse_kernel = Kernel(_window_lse_kernel)
window_probs_kernel = Kernel(_window_probs_kernel)


def tile_shape(group: int, n: int) -> tuple[int, int, int]:
    """``(G_TILE, N_TILE, HEAD_TILES)``: the query tile holds ``G_TILE`` heads' ``N_TILE >= n`` rows,
    at most 128 rows (registers) and at least 16 (``tl.dot``); padding rows are masked."""
    n_tile = triton.next_power_of_2(n)
    g_tile = max(min(triton.next_power_of_2(group), max(1, 128 // n_tile)), triton.cdiv(16, n_tile))
    return g_tile, n_tile, triton.cdiv(group, g_tile)


def _chunk(rows: int, width: int, block: int) -> int:
    """Tokens per program (a multiple of ``block``), evened out so the last chunk is not a sliver."""
    chunk = items_per_program(rows, width, block, min_blocks=CONFIG["min_tiles"], max_blocks=CONFIG["max_tiles"])
    return triton.cdiv(triton.cdiv(width, triton.cdiv(width, chunk)), block) * block


def window_probs_triton(queries, k_cache, block_table, kv_lens, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Inputs validated by ``sparse_kernels.window_probs``; ``n <= MAX_WINDOW``, ``out`` contiguous."""
    batch, n, num_qo_heads, head_dim = queries.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    width = out.shape[2]
    group = num_qo_heads // num_kv_heads
    if queries.stride(3) != 1:
        queries = queries.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    g_tile, n_tile, head_tiles = tile_shape(group, n)
    block_t = CONFIG["BLOCK_T"]
    rows = batch * num_kv_heads * head_tiles
    num_keys = block_table.shape[1] * block_size
    lse_chunk = _chunk(rows, num_keys, block_t)
    num_splits = triton.cdiv(num_keys, lse_chunk)
    out_chunk = _chunk(rows, width, block_t)
    m_part = torch.empty(num_splits, batch, num_qo_heads, n, dtype=torch.float32, device=queries.device)
    s_part = torch.empty_like(m_part)
    # 16-bit dots when the queries and the keys share a 16-bit dtype, fp32 otherwise.
    dots = dot_args(k_cache.dtype if queries.dtype == k_cache.dtype else torch.float32, queries.device)
    strides = (queries.stride(0), queries.stride(1), queries.stride(2), block_table.stride(0))
    meta = dict(
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_TILES=head_tiles,
        G_TILE=g_tile, N_TILE=n_tile, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_T=block_t,
        num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"], **dots, **pdl_args(queries.device),
    )  # fmt: skip
    scale_log2 = scale * LOG2_E
    window_lse_kernel[(batch, num_kv_heads * head_tiles, num_splits)](
        queries, k_cache, block_table, kv_lens, m_part, s_part, *strides, n, lse_chunk, scale_log2, **meta
    )
    window_probs_kernel[(batch, num_kv_heads * head_tiles, triton.cdiv(width, out_chunk))](
        queries, k_cache, block_table, kv_lens, m_part, s_part, out,
        *strides, n, num_splits, out_chunk, width, scale_log2, **meta,
    )  # fmt: skip
    return out
