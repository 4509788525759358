"""Triton paged prefill over quantized KV (fp8, KIVI, TurboQuant): K/V tiles dequantized in registers.

Same tiling, causal alignment and GQA as ``prefill.py``: grid ``(num_q_tiles, num_qo_heads)``, query ``i``
of a request with ``qo_len`` queries and ``kv_len`` keys sits at position ``kv_len - qo_len + i``. The
history is never copied out dense: each program reads codes and scales tile by tile, as the quantized
decode does (``quantized_tiles.py``). KIVI steps one page at a time; its request's tokens at or past
``(kv_len // S) * S`` (the incomplete page, which holds the newest of the chunk's tokens) come from the
request's tail row. TurboQuant's queries arrive rotated and its output leaves rotated (the host turns both).
"""

from __future__ import annotations

import torch
import triton.language as tl

from sparse_kernels._triton.launch import Kernel
from sparse_kernels._triton.prefill import TritonPrefillPlan, request_span
from sparse_kernels._triton.quantized_decode_launch import kv_pointers, quant_dot_args, scheme_args
from sparse_kernels._triton.quantized_tiles import (
    kivi_key_page,
    kivi_value_tile,
    online_softmax,
    token_scores,
    token_values,
)
from sparse_kernels.quantized_kv import QuantizedKV


def _quantized_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_min_ptr,
    v_min_ptr,
    k_tail_ptr,
    v_tail_ptr,
    codebook_ptr,
    out_ptr,
    tile_req_ptr,
    tile_row_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_len_ptr,
    tail_index_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    scale_log2,
    SCHEME: tl.constexpr,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GROUP
    b, row0, qo_lo, qo_len, page_lo, kv_len = request_span(
        tile, tile_req_ptr, tile_row_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_last_len_ptr, BLOCK_SIZE
    )

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < qo_len
    mask_d = offs_d < HEAD_DIM
    rows_q = (qo_lo + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows_q[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    q_pos = kv_len - qo_len + offs_m  # padded rows sit past the end: they see every key, harmlessly
    if CAUSAL:
        hi = tl.minimum(kv_len, kv_len - qo_len + row0 + BLOCK_M)
    else:
        hi = kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, BLOCK_N)
    if SCHEME == 1:  # KIVI: full pages from codes, the incomplete last page from the tail
        q_scaled = q * scale_log2
        full = (kv_len // BLOCK_SIZE) * BLOCK_SIZE
        for start in range(0, tl.minimum(hi, full), BLOCK_N):
            block = tl.load(kv_indices_ptr + page_lo + start // BLOCK_SIZE).to(tl.int64)
            rows = (block * BLOCK_SIZE + offs_t) * NUM_KV_HEADS + h
            s = kivi_key_page(
                q_scaled, k_ptr, k_scale_ptr, k_min_ptr, block, h, rows, offs_d, mask_d,
                BITS, CPW, WORDS, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE, PRECISION,
            )  # fmt: skip
            if CAUSAL:
                s = tl.where((start + offs_t)[None, :] <= q_pos[:, None], s, float("-inf"))
            p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
            v = kivi_value_tile(
                v_ptr, v_scale_ptr, v_min_ptr, rows, offs_d, offs_t < BLOCK_N, mask_d,
                BITS, CPW, WORDS, NUM_GROUPS, BLOCK_SIZE, BLOCK_D, BLOCK_N, UNPACK_WORDS,
            )  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        if hi > full:
            tail = tl.load(tail_index_ptr + b).to(tl.int64)
            offs_n = full + offs_t
            mask_n = offs_n < hi
            rows = ((tail * BLOCK_SIZE + offs_t) * NUM_KV_HEADS + h) * HEAD_DIM
            k = tl.load(k_tail_ptr + rows[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            s = tl.dot(q_scaled.to(DOT_DTYPE), k.to(DOT_DTYPE), input_precision=PRECISION)
            keep = mask_n[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= q_pos[:, None])
            p, alpha, l_i, m_i = online_softmax(tl.where(keep, s, float("-inf")), m_i, l_i)
            v = tl.load(v_tail_ptr + rows[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    else:  # fp8 / TurboQuant: codes per token, one scale per (token, head)
        q_dot = q.to(DOT_DTYPE)
        for start in range(0, hi, BLOCK_N):
            offs_n = start + offs_t
            mask_n = offs_n < hi
            rows, s = token_scores(
                q_dot, k_ptr, k_scale_ptr, codebook_ptr, kv_indices_ptr, page_lo, start, hi, offs_n, mask_n, h, offs_d,
                mask_d, scale_log2, SCHEME, BITS, CPW, WORDS, BLOCK_SIZE, NUM_KV_HEADS, BLOCK_D, BLOCK_N, UNPACK_WORDS,
                DOT_DTYPE, PRECISION,
            )  # fmt: skip
            keep = mask_n[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= q_pos[:, None])
            p, alpha, l_i, m_i = online_softmax(tl.where(keep, s, float("-inf")), m_i, l_i)
            acc = token_values(
                acc, p, alpha, v_ptr, v_scale_ptr, codebook_ptr, rows, offs_d, mask_n, mask_d,
                SCHEME, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE, PRECISION,
            )  # fmt: skip
    tl.store(
        out_ptr + rows_q[:, None] * stride_ot + hq * stride_oh + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


quantized_prefill_kernel = Kernel(_quantized_prefill_kernel)

# Tile sizes of the per-token schemes; KIVI steps one page (BLOCK_N = block size).
QUANT_PREFILL_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def run_quantized_prefill_triton(
    plan: TritonPrefillPlan, tail_index: torch.Tensor | None, q: torch.Tensor, kv: QuantizedKV, out: torch.Tensor
) -> torch.Tensor:
    """Launch over the plan (``q`` already rotated for TurboQuant); ``out`` in ``q``'s dtype."""
    if q.stride(2) != 1:
        q = q.contiguous()
    kivi = kv.scheme == "kivi"
    scheme = scheme_args(kv)
    quantized_prefill_kernel[(plan.tile_req.numel(), plan.num_qo_heads)](
        q,
        *kv_pointers(kv),
        out,
        plan.tile_req,
        plan.tile_row,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_len,
        plan.kv_last_len if tail_index is None else tail_index,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        plan.sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        NUM_KV_HEADS=plan.num_kv_heads,
        GROUP=plan.num_qo_heads // plan.num_kv_heads,
        HEAD_DIM=plan.head_dim,
        BLOCK_SIZE=plan.block_size,
        CAUSAL=plan.causal,
        BLOCK_M=plan.tile_queries,
        BLOCK_N=kv.block_size if kivi else QUANT_PREFILL_CONFIG["BLOCK_N"],
        **scheme,
        **quant_dot_args(q.device),
        num_warps=QUANT_PREFILL_CONFIG["num_warps"],
        num_stages=QUANT_PREFILL_CONFIG["num_stages"],
    )
    return out
