"""Triton ``cluster_logits``: program ``(row, KV head, run of column tiles)`` loads the group's queries once,
then per tile of the row's centroids (read from the arena) one ``tl.dot`` (float32 accumulation) gives the
tile's logits for every query head of the group, and the tile's softmax statistics (max, sum of exponentials)
per head. ``TILES_PER_PROGRAM`` tiles run in one program's pipelined loop (``NUM_STAGES``): 1 is a tile a
program, the loads in flight coming only from resident programs. int8 centroid codes (``CODES``) enter the dot
as exact fp16 values (on the GPU by byte permutes, ``int8_codes.int8_to_fp16``) against the query in fp16,
and each column's logit is then scaled by its centroid's scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.int8_codes import int8_to_fp16
from sparse_kernels._triton.launch import Kernel, dot_args, pdl_args, pdl_enter, pdl_exit

BLOCK_C = 128  # cluster columns per tile
NUM_WARPS = 4  # benchmarks/retroinfer_kernel_probe.py sweeps these
# H200, batch 5 / 128K: 4 tiles a program took 26.7 us a layer against 27.8 at 1 in session 20's probe, but
# 1.051 ms a step in the engine against 1.00 (two calls on two machines): kept at 1 until measured side by side.
TILES_PER_PROGRAM = 1
NUM_STAGES = 2
# Session 21: the centroids' load masked by the clusters' bounds only (not waiting for the sizes) took 33.2 us a
# layer against session 20's 27.8 in the probe, and 1.156 ms a step in the engine against 1.00-1.05: not kept.


def _cluster_logits_kernel(
    q_ptr, c_ptr, cs_ptr, size_ptr, base_ptr, count_ptr, logit_ptr, size_out_ptr, tmax_ptr, tsum_ptr, scale, total,
    columns, tiles,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    TILES: tl.constexpr, STAGES: tl.constexpr, CODES: tl.constexpr, PRMT: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    base = tl.load(base_ptr + r)
    count = tl.load(count_ptr + r)
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (r * (HEADS * GROUP) + h * GROUP + g)[:, None] * HEAD_DIM + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]
    for i in tl.range(0, TILES, num_stages=STAGES):
        t = tl.program_id(2) * TILES + i
        col = t * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = col < columns
        cid = tl.minimum(base + col, total - 1)
        size = tl.load(size_ptr + h * total + cid, mask=cmask & (col < count), other=0)
        live = size > 0
        c = tl.load(
            c_ptr + (h * total + cid)[None, :] * HEAD_DIM + d[:, None], mask=live[None, :] & dmask[:, None], other=0
        )  # [BLOCK_D, BLOCK_C]
        if PRMT:  # int8 codes to fp16 by byte permutes, exact
            c = int8_to_fp16(c)
        s = tl.dot(q, c.to(DOT_DTYPE), input_precision=PRECISION) * scale  # float32 [BLOCK_G, BLOCK_C]
        if CODES:  # the codes' logits times each centroid's scale
            s = s * tl.load(cs_ptr + h * total + cid, mask=live, other=0.0)[None, :]
        s = tl.where(live[None, :], s, float("-inf"))
        out = ((r * HEADS + h) * GROUP + g)[:, None] * columns + col[None, :]
        tl.store(logit_ptr + out, s, mask=gmask[:, None] & cmask[None, :])
        tl.store(size_out_ptr + (r * HEADS + h) * columns + col, size, mask=cmask)
        m = tl.max(s, axis=1)  # [BLOCK_G]: -inf when the tile has no live cluster
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total_exp = tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        stat = ((r * HEADS + h) * GROUP + g) * tiles + t
        smask = gmask & (g * 0 + t < tiles)
        tl.store(tmax_ptr + stat, m, mask=smask)
        tl.store(tsum_ptr + stat, total_exp, mask=smask)
    pdl_exit(USE_GDC)


cluster_logits_kernel = Kernel(_cluster_logits_kernel)


def cluster_logits_triton(query, centroids, sizes, bases, counts, columns: int, scale: float, centroid_scale=None):
    n, q_heads, dim = query.shape
    heads, total, _ = centroids.shape
    group = q_heads // heads
    codes = centroid_scale is not None
    # 16-bit dots for a 16-bit query over centroids of its dtype, or over int8 codes (exact in fp16, the query
    # converted to fp16 in the kernel); float32 dots otherwise
    half = query.dtype in (torch.bfloat16, torch.float16) and (codes or query.dtype == centroids.dtype)
    logits = torch.empty(n, heads, group, columns, dtype=torch.float32, device=query.device)
    size = torch.empty(n, heads, columns, dtype=torch.int32, device=query.device)
    tiles = triton.cdiv(columns, BLOCK_C)
    tile_max = torch.empty(n, heads, group, tiles, dtype=torch.float32, device=query.device)
    tile_sum = torch.empty_like(tile_max)
    cluster_logits_kernel[(n, heads, triton.cdiv(tiles, TILES_PER_PROGRAM))](
        query.contiguous(),
        centroids.contiguous(),
        centroid_scale.contiguous() if codes else sizes,
        sizes.to(torch.int32).contiguous(),
        bases.to(torch.int64).contiguous(),
        counts.to(torch.int64).contiguous(),
        logits,
        size,
        tile_max,
        tile_sum,
        float(scale),
        total,
        columns,
        tiles,
        HEADS=heads,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_C=BLOCK_C,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        **dot_args((torch.float16 if codes else query.dtype) if half else torch.float32, query.device),
        TILES=TILES_PER_PROGRAM,
        STAGES=NUM_STAGES,
        CODES=codes,
        PRMT=codes and half and query.device.type == "cuda",
        num_warps=NUM_WARPS,
        **pdl_args(query.device),
    )
    return logits, size, tile_max, tile_sum
