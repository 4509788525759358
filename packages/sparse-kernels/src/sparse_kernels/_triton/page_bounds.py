"""Triton ``page_bounds``: program ``(row, KV head, chunk)`` streams its chunk of the row's pages.

Each loop step reads ``BLOCK_P`` pages' min/max rows of the head (``head_dim`` contiguous values each,
through the table) and scores them against the whole query group at once with two tensor-core dots:
``kmax @ max(q, 0)^T + kmin @ min(q, 0)^T`` is ``[BLOCK_P, group]``, each entry one query's
``sum_d max(q_d * kmax_d, q_d * kmin_d)``, and the page's bound is its max over the group. The
products of 16-bit values are exact in fp32, so only the summation order differs from the reference.
Chunks cover a fixed grid (``stream_split``); the loop is pipelined (``num_stages``), so loads of the
next pages are in flight while one step computes. Pages past a row are written ``-inf`` without reads.
With ``LEVELS`` (KIVI's per-channel min and step: ``kmax = kmin + LEVELS * step``) the bound is
``kmin @ q^T + LEVELS * (step @ max(q, 0)^T)``, the same sum regrouped (fp16 statistics, fp16 query).
int8 codes go to fp16 dots (the query in fp16: exact for a bf16 query within fp16's normal range). The
hardware's int-to-float conversion runs at a quarter of the FMA rate, so on the GPU
(``CODES_CONFIG["prmt"]``) four codes at a time become fp16 through byte permutes: ``0x6400 | (code +
128)`` is the fp16 ``1152 + code``, and one packed subtraction per pair leaves ``code`` (2-8% faster on the
H200 than the conversion; the kernel stays at ~70-80% of copy bandwidth, so the conversion was not all
that bounds it). A bfloat16 ``out`` is rounded to nearest in integer ops before the store (the
interpreter's cast truncates; the GPU's rounds).

``heads_together`` (a key of ``CONFIG`` / ``CODES_CONFIG``) launches a second kernel instead, one program per
``(row, chunk)``: each step reads ``BLOCK_P_TOGETHER`` pages' summaries of all KV heads (one contiguous
``num_kv_heads * head_dim`` block per page for kmin and one for kmax, in place of ``num_kv_heads`` programs'
``head_dim`` pieces) as a ``[pages * heads, head_dim]`` tile, dots it against all the row's query heads at
once and keeps, per tile row, the columns of its head's group. It is a kernel of its own (not a constexpr
branch of the first) because its grid, its indexing and its masks differ throughout; the per-page arithmetic
(the two dots, the scale, the forced pages, the rounding) is the same, so it is exact in the same sense.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.int8_codes import int8_to_fp16
from sparse_kernels._triton.launch import Kernel, dot_args, pdl_args, pdl_enter, pdl_exit
from sparse_kernels._triton.stream_split import items_per_program

# Pages per loop step and launch shape, for model-dtype summaries and for int8 codes
# (benchmarks/quest_select_probe.py sweeps these; session 15 on the H200: 2 warps over 4, 86 -> 91% of copy
# bandwidth for bf16, 50 -> 72% for codes; session 18's graph-timed sweep of the prmt kernel kept them).
# ``heads_together``: the kernel over all KV heads of a page instead, ``BLOCK_P_TOGETHER`` pages a step (a tile
# of that many times ``num_kv_heads`` rows); off: on the H200 at batch 5 / 128K (8 pages a step, 4 warps) it took
# 1.45 ms a step against 0.92 and the engine 8.09 ms a step against 7.56 (results/bench/h200/session33/c1/). The
# tile key stays first (the probe's sweeps set it).
CONFIG = {"BLOCK_P": 64, "num_warps": 2, "num_stages": 3, "heads_together": False, "BLOCK_P_TOGETHER": 16}
CODES_CONFIG = {
    "BLOCK_P": 64,
    "num_warps": 2,
    "num_stages": 3,
    "prmt": True,
    "heads_together": False,
    "BLOCK_P_TOGETHER": 16,
}
# Engine A/B runs: ``SPARSE_KERNELS_PAGE_BOUNDS_TOGETHER=P:W`` turns ``heads_together`` on at ``P`` pages a step
# in ``W`` warps, for both configs.
_TOGETHER = os.environ.get("SPARSE_KERNELS_PAGE_BOUNDS_TOGETHER", "").strip()
if _TOGETHER:
    _pages, _warps = (int(x) for x in _TOGETHER.split(":"))
    for _config in (CONFIG, CODES_CONFIG):
        _config.update(heads_together=True, BLOCK_P_TOGETHER=_pages, num_warps=_warps)


def _page_bounds_kernel(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    scale_ptr,
    table_ptr,
    start_ptr,
    num_pages_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    max_pages,
    chunk,
    sink,
    recent,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    LEVELS: tl.constexpr,
    PRMT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, max_pages)
    pdl_enter(USE_GDC)  # q and the summaries are written by the step's earlier kernels
    start = tl.load(start_ptr + b).to(tl.int64)
    num_pages = tl.load(num_pages_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    heads = h * GROUP + offs_g
    q = tl.load(  # [BLOCK_D, BLOCK_G]: the group's queries as columns
        q_ptr + b.to(tl.int64) * stride_qb + heads[None, :] * stride_qh + offs_d[:, None],
        mask=(offs_g[None, :] < GROUP) & mask_d[:, None],
        other=0.0,
    ).to(tl.float32)
    q_pos = tl.maximum(q, 0.0).to(DOT_DTYPE)
    q_neg = tl.minimum(q, 0.0).to(DOT_DTYPE)
    q_all = q.to(DOT_DTYPE)
    out_row = out_ptr + (b.to(tl.int64) * NUM_KV_HEADS + h) * max_pages
    for p0 in range(lo, hi, BLOCK_P):
        pages = p0 + tl.arange(0, BLOCK_P)
        valid = pages < num_pages
        ids = tl.load(table_ptr + start + pages, mask=valid, other=0).to(tl.int64)
        s = _summary_scores(kmin_ptr, kmax_ptr, scale_ptr, ids * NUM_KV_HEADS + h, valid, offs_d, mask_d, q_pos,
                            q_neg, q_all, HEAD_DIM, DOT_DTYPE, PRECISION, HAS_SCALE, LEVELS, PRMT)  # fmt: skip
        best = tl.max(tl.where(offs_g[None, :] < GROUP, s, float("-inf")), axis=1)  # s [BLOCK_P, BLOCK_G]
        best = _page_bound(best, pages, valid, num_pages, sink, recent, ROUND_BF16)
        tl.store(out_row + pages, best.to(out_ptr.dtype.element_ty), mask=pages < hi)
    pdl_exit(USE_GDC)


page_bounds_kernel = Kernel(_page_bounds_kernel)


def _page_bounds_heads_kernel(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    scale_ptr,
    table_ptr,
    start_ptr,
    num_pages_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    max_pages,
    chunk,
    sink,
    recent,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    LEVELS: tl.constexpr,
    PRMT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Program ``(row, chunk)``: every KV head of the chunk's pages. Tile row ``r`` is page ``r // BLOCK_H``
    of the step and KV head ``r % BLOCK_H`` (``BLOCK_H``: the KV heads rounded up to a power of two), so a
    page's heads are consecutive rows, read from one contiguous block of the summaries."""
    b = tl.program_id(0)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, max_pages)
    pdl_enter(USE_GDC)  # q and the summaries are written by the step's earlier kernels
    start = tl.load(start_ptr + b).to(tl.int64)
    num_pages = tl.load(num_pages_ptr + b)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    has_q = offs_q < NUM_KV_HEADS * GROUP
    q = tl.load(  # [BLOCK_D, BLOCK_Q]: all the row's queries as columns
        q_ptr + b.to(tl.int64) * stride_qb + offs_q[None, :] * stride_qh + offs_d[:, None],
        mask=has_q[None, :] & mask_d[:, None],
        other=0.0,
    ).to(tl.float32)
    q_pos = tl.maximum(q, 0.0).to(DOT_DTYPE)
    q_neg = tl.minimum(q, 0.0).to(DOT_DTYPE)
    q_all = q.to(DOT_DTYPE)
    col_head = tl.where(has_q, offs_q // GROUP, -1)  # each column's KV head (-1: padding, no row's)
    offs_r = tl.arange(0, BLOCK_P * BLOCK_H)
    head = offs_r % BLOCK_H
    has_head = head < NUM_KV_HEADS
    out_rows = out_ptr + (b.to(tl.int64) * NUM_KV_HEADS + head) * max_pages
    for p0 in range(lo, hi, BLOCK_P):
        pages = p0 + offs_r // BLOCK_H
        valid = (pages < num_pages) & has_head
        ids = tl.load(table_ptr + start + pages, mask=valid, other=0).to(tl.int64)  # one entry per page's heads
        # the (page, head) row of the summaries and of the scales; s [BLOCK_P * BLOCK_H, BLOCK_Q]
        s = _summary_scores(kmin_ptr, kmax_ptr, scale_ptr, ids * NUM_KV_HEADS + head, valid, offs_d, mask_d, q_pos,
                            q_neg, q_all, HEAD_DIM, DOT_DTYPE, PRECISION, HAS_SCALE, LEVELS, PRMT)  # fmt: skip
        best = tl.max(tl.where(col_head[None, :] == head[:, None], s, float("-inf")), axis=1)  # own group only
        best = _page_bound(best, pages, valid, num_pages, sink, recent, ROUND_BF16)
        tl.store(out_rows + pages, best.to(out_ptr.dtype.element_ty), mask=(pages < hi) & has_head)
    pdl_exit(USE_GDC)


page_bounds_heads_kernel = Kernel(_page_bounds_heads_kernel)


@triton.jit
def _summary_scores(
    kmin_ptr, kmax_ptr, scale_ptr, summary, valid, offs_d, mask_d, q_pos, q_neg, q_all,
    HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr,
    LEVELS: tl.constexpr, PRMT: tl.constexpr,
):  # fmt: skip
    """Quest's bound of each (page, KV head) row ``summary`` of the summaries against each query column:
    ``kmax @ max(q, 0) + kmin @ min(q, 0)`` (``LEVELS``: KIVI's ``kmin @ q + LEVELS * step @ max(q, 0)``), times the
    row's scale for int8 codes; ``[rows, columns]``."""
    rows = summary * HEAD_DIM
    m2 = valid[:, None] & mask_d[None, :]
    top = tl.load(kmax_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0)
    low = tl.load(kmin_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0)
    if PRMT:  # int8 codes to fp16 (DOT_DTYPE) by byte permutes, exact
        top, low = int8_to_fp16(top), int8_to_fp16(low)
    if LEVELS > 0:  # top is the per-channel step: q.min + LEVELS * (max(q, 0) . step)
        s = tl.dot(top.to(DOT_DTYPE), q_pos, input_precision=PRECISION) * LEVELS
        s = tl.dot(low.to(DOT_DTYPE), q_all, acc=s, input_precision=PRECISION)
    else:
        s = tl.dot(top.to(DOT_DTYPE), q_pos, input_precision=PRECISION)
        s = tl.dot(low.to(DOT_DTYPE), q_neg, acc=s, input_precision=PRECISION)
    if HAS_SCALE:  # int8 codes: the bound is the (page, head)'s scale times the codes' bound
        s = s * tl.load(scale_ptr + summary, mask=valid, other=0.0)[:, None]
    return s


@triton.jit
def _page_bound(best, pages, valid, num_pages, sink, recent, ROUND_BF16: tl.constexpr):
    """A page's bound as stored: ``inf`` for the forced sink and recent pages, ``-inf`` past the row, rounded to
    bfloat16 (to nearest, ties to even, in integer ops: the interpreter's own cast truncates) for a bf16 out."""
    forced = (pages < sink) | (pages >= num_pages - recent)
    best = tl.where(forced, float("inf"), best)
    best = tl.where(valid, best, float("-inf"))
    if ROUND_BF16:
        bits = best.to(tl.int32, bitcast=True)
        best = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return best


def page_bounds_triton(
    q, kmin, kmax, table_indices, table_start, num_pages, out, sink: int, recent: int, scale=None, *, levels: int = 0
) -> torch.Tensor:
    """Inputs already validated by ``sparse_kernels.page_bounds``; ``out`` must be contiguous."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    max_pages = out.shape[2]
    if q.stride(2) != 1:
        q = q.contiguous()
    if not (kmin.is_contiguous() and kmax.is_contiguous()):
        raise ValueError("kmin and kmax must be contiguous")
    group = num_qo_heads // num_kv_heads
    coded = scale is not None
    config = CODES_CONFIG if coded else CONFIG
    together = config.get("heads_together", False)
    block_h = triton.next_power_of_2(num_kv_heads)
    if together:  # tl.dot needs M >= 16: at least 16 // block_h pages a step
        block_p = max(config["BLOCK_P_TOGETHER"], 16 // block_h)
        chunk = items_per_program(batch, max_pages, block_p)
    else:
        block_p = config["BLOCK_P"]
        chunk = items_per_program(batch * num_kv_heads, max_pages, block_p)
    # 16-bit dots when the query and the summaries share a 16-bit dtype (int8 codes are exact in the
    # query's), fp32 otherwise. KIVI's fp16 statistics: fp16 dots (a bf16 query is exact in fp16 within
    # its normal range).
    prmt = coded and config.get("prmt", False) and q.device.type == "cuda"  # codes permuted into fp16
    if prmt or (levels and kmin.dtype == kmax.dtype == torch.float16):
        dots = dot_args(torch.float16, q.device)
    else:
        dots = dot_args(q.dtype if coded or q.dtype == kmin.dtype == kmax.dtype else torch.float32, q.device)
    if together:
        kernel, grid = page_bounds_heads_kernel, (batch, triton.cdiv(max_pages, chunk))
        heads = {"BLOCK_H": block_h, "BLOCK_Q": max(16, triton.next_power_of_2(num_qo_heads))}  # tl.dot: N >= 16
    else:
        kernel, grid = page_bounds_kernel, (batch, num_kv_heads, triton.cdiv(max_pages, chunk))
        heads = {"BLOCK_G": max(16, triton.next_power_of_2(group))}  # tl.dot needs N >= 16
    kernel[grid](
        q,
        kmin,
        kmax,
        scale if coded else kmin,
        table_indices,
        table_start,
        num_pages,
        out,
        q.stride(0),
        q.stride(1),
        max_pages,
        chunk,
        sink,
        recent,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        **heads,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_P=block_p,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        HAS_SCALE=coded,
        LEVELS=levels,
        PRMT=prmt,
        ROUND_BF16=out.dtype == torch.bfloat16,
        **dots,
        **pdl_args(q.device),
    )
    return out
