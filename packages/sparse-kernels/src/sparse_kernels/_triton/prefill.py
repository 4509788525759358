"""Triton paged prefill over a cached prefix: varlen queries, causal mask aligned to each KV end, GQA.

Grid ``(num_q_tiles, num_kv_heads * GROUP // PACK)``. ``plan`` cuts every request's queries into tiles
of ``BLOCK_M // PACK`` queries and lists each tile's request and first query, so the kernel needs no
search. With ``PACK = GROUP`` one program holds the tile's queries for all ``GROUP`` query heads of a
KV head as its ``BLOCK_M`` rows (row ``r``: query ``r // PACK``, head ``r % PACK`` of the group), so
each K/V tile read from the pages serves the whole group; with ``PACK = 1`` a program holds one query
head.

Query ``i`` of a request with ``qo_len`` queries and ``kv_len`` keys sits at position
``kv_len - qo_len + i``. Causal tiles are read in two loops: the keys every row of the tile sees
(up to the tile's first query position) without masks, then the diagonal with the causal mask.
``WINDOW_LEFT >= 0`` limits each query at ``p`` to keys ``p - WINDOW_LEFT .. p`` (every tile masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args


@triton.jit
def request_span(
    tile, tile_req_ptr, tile_row_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_last_len_ptr, BLOCK_SIZE: tl.constexpr
):
    """Query tile ``tile``'s request ``b`` and first row, the request's first query row and query count,
    its first page in ``kv_indices`` and its KV length (shared by the prefill kernels)."""
    b = tl.load(tile_req_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    qo_lo = tl.load(qo_indptr_ptr + b)
    qo_len = tl.load(qo_indptr_ptr + b + 1) - qo_lo
    page_lo = tl.load(kv_indptr_ptr + b)
    kv_len = (tl.load(kv_indptr_ptr + b + 1) - page_lo - 1) * BLOCK_SIZE + tl.load(kv_last_len_ptr + b)
    return b, row0, qo_lo, qo_len, page_lo, kv_len


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    start,
    q_pos,
    hi,
    k_ptr,
    v_ptr,
    kv_indices_ptr,
    page_lo,
    kv_head_off,
    offs_d,
    mask_d,
    scale_log2,
    window_left,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One KV tile ``[start, start + BLOCK_N)`` folded into the online softmax of the program's rows."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < hi
        block = tl.load(kv_indices_ptr + page_lo + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
    else:
        block = tl.load(kv_indices_ptr + page_lo + offs_n // BLOCK_SIZE)
    kv_row = (block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head_off
    kv_off = kv_row[:, None] + offs_d[None, :]
    if MASKED:
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptr + kv_off)
        v = tl.load(v_ptr + kv_off)
    else:
        k = tl.load(k_ptr + kv_off, mask=mask_d[None, :], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=mask_d[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        keep = mask_n[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW:
            keep = keep & (offs_n[None, :] >= q_pos[:, None] - window_left)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED and WINDOW:
        # A row may see no key of a tile before its window starts: keep its state finite.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return acc, m_new, l_i


def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
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
    window_left,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PACK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head0 = tl.program_id(1) * PACK  # first query head of this program
    h = head0 // GROUP
    b, row0, qo_lo, qo_len, page_lo, kv_len = request_span(
        tile, tile_req_ptr, tile_row_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_last_len_ptr, BLOCK_SIZE
    )

    QUERIES: tl.constexpr = BLOCK_M // PACK
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = row0 + offs_r // PACK  # the query of each row
    heads = head0 + offs_r % PACK
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < qo_len
    mask_d = offs_d < HEAD_DIM
    rows = (qo_lo + offs_m).to(tl.int64)
    q_off = rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    q_pos = kv_len - qo_len + offs_m  # padded rows sit past the end: they see every key, harmlessly
    first_pos = kv_len - qo_len + row0
    if CAUSAL:
        hi = tl.minimum(kv_len, first_pos + QUERIES)
    else:
        hi = kv_len
    # Keys below ``full`` are seen by every row of the tile: no mask needed there.
    if WINDOW:
        lo = tl.maximum(first_pos - window_left, 0) // BLOCK_N * BLOCK_N
        full = lo
    elif CAUSAL:
        lo = 0
        full = (first_pos + 1) // BLOCK_N * BLOCK_N
    else:
        lo = 0
        full = kv_len // BLOCK_N * BLOCK_N
    kv_head_off = h * HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, full, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, q_pos, hi, k_ptr, v_ptr, kv_indices_ptr, page_lo, kv_head_off, offs_d,
            mask_d, scale_log2, window_left, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, EVEN_D, CAUSAL,
            WINDOW, DOT_DTYPE, PRECISION,
        )  # fmt: skip
    for start in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, q_pos, hi, k_ptr, v_ptr, kv_indices_ptr, page_lo, kv_head_off, offs_d,
            mask_d, scale_log2, window_left, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, EVEN_D, CAUSAL,
            WINDOW, DOT_DTYPE, PRECISION,
        )  # fmt: skip
    out_off = rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(
        out_ptr + out_off,
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )
    if STORE_LSE:  # natural-log log-sum-exp of each row's scaled scores, [T, num_qo_heads] float32
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
        tl.store(lse_ptr + rows * (NUM_KV_HEADS * GROUP) + heads, lse, mask=mask_m)


prefill_kernel = Kernel(_prefill_kernel)

# Tile sizes; ``PACK`` says whether a program holds a KV head's whole query group (GQA sharing of the
# K/V tile loads). The GPU defaults suit head_dim 64-128 in bf16; fp32 runs IEEE dots at the same tiles.
PREFILL_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": True, "num_warps": 4, "num_stages": 3}


def _pack(config: dict, group: int) -> int:
    """Query heads per program: the whole GQA group when packing is asked for and it divides ``BLOCK_M``."""
    return group if config["PACK"] and config["BLOCK_M"] % group == 0 else 1


def tile_queries(num_qo_heads: int, num_kv_heads: int, config: dict | None = None) -> int:
    """Queries per tile of the plan: ``BLOCK_M`` rows, shared by the group's heads when packed."""
    config = config or PREFILL_CONFIG
    return config["BLOCK_M"] // _pack(config, num_qo_heads // num_kv_heads)


@dataclass(frozen=True, slots=True)
class TritonPrefillPlan:
    """Device tensors of one prefill step (all int32) and the layout ``run`` checks against."""

    tile_req: torch.Tensor  # [num_tiles]: request of each query tile
    tile_row: torch.Tensor  # [num_tiles]: first query of the tile within its request
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
    tile_queries: int = 64  # queries per tile (what ``tile_req``/``tile_row`` were cut with)
    window_left: int = -1  # a query at p sees keys p - window_left .. p; -1: no window


def query_tiles(qo_lens: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``(tile_req, tile_row)`` covering every request's ``qo_len`` rows in ``block_m`` steps."""
    tiles_per_req = (qo_lens + block_m - 1) // block_m
    tile_req = torch.repeat_interleave(torch.arange(qo_lens.numel()), tiles_per_req)
    first = torch.cumsum(tiles_per_req, 0) - tiles_per_req
    tile_row = (torch.arange(tile_req.numel()) - first[tile_req]) * block_m
    return tile_req.to(torch.int32), tile_row.to(torch.int32)


def run_prefill_triton(
    plan: TritonPrefillPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out, config=None, lse=None
):
    """Launch over the plan; ``q``/``out`` rows may be strided, the last dim must be unit-stride.

    ``lse``: a contiguous float32 ``[T, num_qo_heads]`` buffer for each row's log-sum-exp (natural
    log of the scaled scores' exp-sum), when given. ``config`` overrides ``PREFILL_CONFIG``
    (benchmarks); its queries per tile must equal the plan's.
    """
    config = dict(PREFILL_CONFIG if config is None else config)
    group = plan.num_qo_heads // plan.num_kv_heads
    pack = _pack(config, group)
    del config["PACK"]
    if config["BLOCK_M"] // pack != plan.tile_queries:
        raise ValueError(f"the plan cut tiles of {plan.tile_queries} queries; config has {config['BLOCK_M'] // pack}")
    q = q.to(k_cache.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    prefill_kernel[(plan.tile_req.numel(), plan.num_qo_heads // pack)](
        q,
        k_cache,
        v_cache,
        out,
        out if lse is None else lse,
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
        max(plan.window_left, 0),
        NUM_KV_HEADS=plan.num_kv_heads,
        GROUP=group,
        STORE_LSE=lse is not None,
        PACK=pack,
        HEAD_DIM=plan.head_dim,
        BLOCK_SIZE=plan.block_size,
        CAUSAL=plan.causal,
        WINDOW=plan.window_left >= 0,
        BLOCK_D=max(16, triton.next_power_of_2(plan.head_dim)),
        **dot_args(k_cache.dtype, k_cache.device),
        **config,
    )
    return out
