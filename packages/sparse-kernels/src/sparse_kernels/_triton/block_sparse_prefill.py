"""Triton block-sparse prefill over paged KV (FlashPrefill's attention) and the block means it scores.

Attention grid ``(num_tiles, num_kv_heads)``: one program per query tile of ``K_BLOCK_M`` packed rows
(every query head of the KV head's group, position major), so each K/V tile loaded serves the whole
group. It reads only the tile's kept key blocks (ascending ids, each ``K_BLOCK_N`` keys gathered page
by page in steps of ``BLOCK_N``), online softmax, causal mask aligned to each KV end; with mean
correction it then folds in each dropped block as one pooled key/value whose logit carries
``log2(block length)`` (the block's tokens, all equal to the mean).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args


@triton.jit
def _online_update(s, v, m_i, l_i, acc, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over logits ``s`` [M, N] (log2 units) and values ``v`` [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return m_new, l_i, acc


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
    b = tl.load(tile_req_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    qo_lo = tl.load(qo_indptr_ptr + b)
    qo_len = tl.load(qo_indptr_ptr + b + 1) - qo_lo
    page_lo = tl.load(kv_indptr_ptr + b)
    kv_len = (tl.load(kv_indptr_ptr + b + 1) - page_lo - 1) * BLOCK_SIZE + tl.load(kv_last_len_ptr + b)

    packed = row0 + tl.arange(0, K_BLOCK_M)
    pos = packed // GROUP
    head = h * GROUP + packed % GROUP
    mask_m = packed < qo_len * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (qo_lo + pos).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [K_BLOCK_M, BLOCK_D]
    q_pos = kv_len - qo_len + pos  # padded rows sit past the end: they see every key, harmlessly

    m_i = tl.full([K_BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([K_BLOCK_M], tl.float32)
    acc = tl.zeros([K_BLOCK_M, BLOCK_D], tl.float32)
    lists = (h * num_tiles + tile).to(tl.int64)
    n_keep = tl.load(keep_counts_ptr + lists)
    for i in range(0, n_keep):
        j = tl.load(keep_ids_ptr + lists * max_blocks + i)
        for sub in range(0, K_BLOCK_N, BLOCK_N):
            offs_n = j * K_BLOCK_N + sub + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_len
            page = tl.load(kv_indices_ptr + page_lo + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
            slot = page.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            kv_row = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM
            k = tl.load(k_ptr + kv_row[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2  # [K_BLOCK_M, BLOCK_N]
            s = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
            v = tl.load(v_ptr + kv_row[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, DOT_DTYPE, PRECISION)
    if MEAN_CORRECTION:
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
            m_i, l_i, acc = _online_update(s, vm, m_i, l_i, acc, DOT_DTYPE, PRECISION)
    o_rows = (qo_lo + pos).to(tl.int64)
    tl.store(
        out_ptr + o_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _block_mean_kernel(
    k_ptr,
    v_ptr,
    slots_ptr,
    k_mean_ptr,
    v_mean_ptr,
    max_blocks,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(max_blocks, B, NUM_KV_HEADS)``: mean key and value of one block, float32 (0 if empty)."""
    j = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    k_sum = tl.zeros([BLOCK_D], tl.float32)
    v_sum = tl.zeros([BLOCK_D], tl.float32)
    count = tl.zeros([ROWS], tl.float32)
    base = (b.to(tl.int64) * max_blocks + j) * K_BLOCK_N
    for r in range(0, K_BLOCK_N, ROWS):
        slot = tl.load(slots_ptr + base + r + tl.arange(0, ROWS))
        valid = slot >= 0
        row = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM
        mask = valid[:, None] & mask_d[None, :]
        k_sum += tl.sum(tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32), 0)
        v_sum += tl.sum(tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32), 0)
        count += valid.to(tl.float32)
    n = tl.maximum(tl.sum(count, 0), 1.0)
    out = ((b.to(tl.int64) * max_blocks + j) * NUM_KV_HEADS + h) * HEAD_DIM + offs_d
    tl.store(k_mean_ptr + out, k_sum / n, mask=mask_d)
    tl.store(v_mean_ptr + out, v_sum / n, mask=mask_d)


block_sparse_prefill_kernel = Kernel(_block_sparse_prefill_kernel)
block_mean_kernel = Kernel(_block_mean_kernel)

# Inner tiles; K_BLOCK_M (the selection's query tile) is the program's row count.
BLOCK_SPARSE_PREFILL_CONFIG = {"BLOCK_N": 64, "BLOCK_C": 32, "num_warps": 8, "num_stages": 2}


def block_means_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """float32 ``[B, max_blocks, Hkv, D]`` mean keys and values of the blocks ``slots`` lists (see the layout)."""
    batch, max_blocks, k_block_n = slots.shape
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_mean = torch.empty(batch, max_blocks, num_kv_heads, head_dim, dtype=torch.float32, device=k_cache.device)
    v_mean = torch.empty_like(k_mean)
    block_mean_kernel[(max_blocks, batch, num_kv_heads)](
        k_cache,
        v_cache,
        slots,
        k_mean,
        v_mean,
        max_blocks,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        K_BLOCK_N=k_block_n,
        ROWS=min(16, k_block_n),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=4,
    )
    return k_mean, v_mean


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
