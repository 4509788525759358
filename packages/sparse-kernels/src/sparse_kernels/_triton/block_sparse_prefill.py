"""Triton block-sparse prefill over paged KV (FlashPrefill's attention).

Grid ``(num_tiles, num_kv_heads)``: one program per query tile of ``K_BLOCK_M`` packed rows (every
query head of the KV head's group, position major), so each K/V tile loaded serves the whole group.
The kept blocks every row sees whole come first in the tile's ascending list: they are read in
``BLOCK_N``-key steps by the dense prefill kernel's own unmasked tile step (``_attend_tile``; the list
entry and the page ids are the only indirection), then the diagonal, the keys from the first block
some row does not see whole up to the tile's last query, in masked steps as the dense kernel does
(every block there is kept: the local window covers it). With mean correction the dropped blocks
then enter as one pooled key/value each, whose logit carries ``log2(block length)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args
from sparse_kernels._triton.prefill import _attend_tile, request_span


@triton.jit
def packed_query_tile(
    q_ptr,
    tile_req_ptr,
    tile_row_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_last_len_ptr,
    stride_qt,
    stride_qh,
    tile,
    h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Query tile ``tile`` of KV head ``h``: its request ``b``, first packed row, the request's first page
    and KV length, query count, and each packed row's query row, head, position and validity; the
    ``[K_BLOCK_M, BLOCK_D]`` queries as stored (padded rows zero). Shared with the selection kernel."""
    b, row0, qo_lo, qo_len, page_lo, kv_len = request_span(
        tile, tile_req_ptr, tile_row_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_last_len_ptr, BLOCK_SIZE
    )
    packed = row0 + tl.arange(0, K_BLOCK_M)
    pos = packed // GROUP
    head = h * GROUP + packed % GROUP
    mask_m = packed < qo_len * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    rows = (qo_lo + pos).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    return b, row0, page_lo, kv_len, qo_len, rows, head, pos, mask_m, offs_d, mask_d, q


def _block_sparse_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    k_mean_ptr,
    v_mean_ptr,
    tile_req_ptr,
    tile_row_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_len_ptr,
    keep_ids_ptr,
    keep_counts_ptr,
    mean_ids_ptr,
    mean_counts_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    num_tiles,
    max_blocks,
    scale_log2,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_BLOCK_M: tl.constexpr,
    K_BLOCK_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MEAN_CORRECTION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b, row0, page_lo, kv_len, qo_len, rows, head, pos, mask_m, offs_d, mask_d, q = packed_query_tile(
        q_ptr, tile_req_ptr, tile_row_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_last_len_ptr, stride_qt, stride_qh,
        tile, h, GROUP, HEAD_DIM, BLOCK_SIZE, K_BLOCK_M, BLOCK_D,
    )  # fmt: skip
    q = q.to(DOT_DTYPE)  # [K_BLOCK_M, BLOCK_D]
    q_pos = kv_len - qo_len + pos  # padded rows sit past the end: they see every key, harmlessly
    first_pos = kv_len - qo_len + row0 // GROUP
    hi = tl.minimum(kv_len, kv_len - qo_len + (row0 + K_BLOCK_M - 1) // GROUP + 1)
    diag = (first_pos + 1) // K_BLOCK_N  # blocks from here on are not seen whole by every row
    last_k = (hi - 1) // K_BLOCK_N
    kv_head_off = h * HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    STEPS: tl.constexpr = K_BLOCK_N // BLOCK_N

    m_i = tl.full([K_BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([K_BLOCK_M], tl.float32)
    acc = tl.zeros([K_BLOCK_M, BLOCK_D], tl.float32)
    lists = (h * num_tiles + tile).to(tl.int64)
    ids = keep_ids_ptr + lists * max_blocks
    n_full = tl.load(keep_counts_ptr + lists) - (last_k - diag + 1)  # the list ends with diag..last_k
    for step in range(0, n_full * STEPS):
        start = tl.load(ids + step // STEPS) * K_BLOCK_N + (step % STEPS) * BLOCK_N
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, q_pos, hi, k_ptr, v_ptr, kv_indices_ptr, page_lo, kv_head_off, offs_d,
            mask_d, scale_log2, 0, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, EVEN_D, True, False,
            DOT_DTYPE, PRECISION,
        )  # fmt: skip
    for start in range(diag * K_BLOCK_N, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, q_pos, hi, k_ptr, v_ptr, kv_indices_ptr, page_lo, kv_head_off, offs_d,
            mask_d, scale_log2, 0, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, EVEN_D, True, False,
            DOT_DTYPE, PRECISION,
        )  # fmt: skip
    if MEAN_CORRECTION:
        # Every row has seen a key by now (the diagonal), so its running max is finite.
        n_mean = tl.load(mean_counts_ptr + lists)
        for c in range(0, n_mean, BLOCK_C):
            offs_c = c + tl.arange(0, BLOCK_C)
            mask_c = offs_c < n_mean
            j = tl.load(mean_ids_ptr + lists * max_blocks + offs_c, mask=mask_c, other=0)
            mean_row = ((b * max_blocks + j).to(tl.int64) * NUM_KV_HEADS + h) * HEAD_DIM
            km = tl.load(k_mean_ptr + mean_row[None, :] + offs_d[:, None], mask=mask_c[None, :] & mask_d[:, None])
            s = tl.dot(q, km.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2
            length = tl.minimum(kv_len - j * K_BLOCK_N, K_BLOCK_N).to(tl.float32)
            s = tl.where(mask_c[None, :], s + tl.log2(length)[None, :], float("-inf"))
            vm = tl.load(v_mean_ptr + mean_row[:, None] + offs_d[None, :], mask=mask_c[:, None] & mask_d[None, :])
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), vm.to(DOT_DTYPE), input_precision=PRECISION)
            m_i = m_new
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


block_sparse_prefill_kernel = Kernel(_block_sparse_prefill_kernel)

# Inner tiles (the dense prefill kernel's best on the H200); K_BLOCK_M, the selection's query tile, is
# the program's row count.
BLOCK_SPARSE_PREFILL_CONFIG = {"BLOCK_N": 64, "BLOCK_C": 32, "num_warps": 4, "num_stages": 3}


def run_block_sparse_prefill_triton(plan, layout, lists, q, k_cache, v_cache, k_mean, v_mean, out):
    """Launch over ``plan`` (a ``TritonPrefillPlan``-like record) and ``layout`` / ``lists`` (selection)."""
    q = q.to(k_cache.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    p = layout.params
    cfg = dict(BLOCK_SPARSE_PREFILL_CONFIG)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], p.k_block_n)
    block_sparse_prefill_kernel[(layout.num_tiles, layout.num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        k_mean,
        v_mean,
        layout.tile_req,
        layout.tile_row,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_len,
        lists.keep_ids,
        lists.keep_counts,
        lists.mean_ids,
        lists.mean_counts,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        layout.num_tiles,
        lists.keep_ids.shape[-1],
        plan.sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        NUM_KV_HEADS=layout.num_kv_heads,
        GROUP=layout.group,
        HEAD_DIM=layout.head_dim,
        BLOCK_SIZE=plan.block_size,
        K_BLOCK_M=p.k_block_m,
        K_BLOCK_N=p.k_block_n,
        BLOCK_D=max(16, triton.next_power_of_2(layout.head_dim)),
        MEAN_CORRECTION=p.use_mean_correction,
        **dot_args(k_cache.dtype, k_cache.device),
        **cfg,
    )
    return out
