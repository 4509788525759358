"""Triton ``paged_logits``: program ``(row, KV head, chunk)`` streams its chunk of the row's tokens.

Each loop step reads ``BLOCK_N`` keys of the head through the table (one contiguous ``head_dim`` row
each, read transposed so the dot needs no transpose) and scores the whole query group with one
tensor-core dot, ``[group, BLOCK_N]``, as the decode kernel does. Chunks cover a fixed grid
(``stream_split``); the loop is pipelined (``num_stages``). Tokens past a row are written ``-inf``.
``K_SCALE``: fp8 codes, each token's score column times its (token, head) scale after the dot; with
``CODEBOOK`` the keys are TurboQuant's packed codebook indices (``quantized_tiles.token_key_tile``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, dot_args, pdl_args, pdl_enter, pdl_exit
from sparse_kernels._triton.quantized_tiles import TURBOQUANT_ID, token_key_tile
from sparse_kernels._triton.stream_split import items_per_program

# Tokens per loop step and launch shape (benchmarks/quest_select_probe.py sweeps these).
CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# Keys as codes with per-token scales, fp8 or TurboQuant (benchmarks/logits_fp8_probe.py, session 17 on the H200,
# fp8, 128K, batch 5 / 11): 2 warps 212.6 / 425.3 us against 4 warps' 304.7 / 631.5 (bf16 keys: within 1% either
# way, so CONFIG stays).
FP8_CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}


def _paged_logits_kernel(
    q_ptr,
    k_ptr,
    k_scale_ptr,
    codebook_ptr,
    table_ptr,
    start_ptr,
    lens_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    max_tokens,
    chunk,
    scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    K_SCALE: tl.constexpr,
    CODEBOOK: tl.constexpr,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, max_tokens)
    pdl_enter(USE_GDC)  # q is written by the step's earlier kernels
    start = tl.load(start_ptr + b).to(tl.int64)
    kv_len = tl.load(lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    heads = h * GROUP + offs_g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]
    out_rows = out_ptr + (b.to(tl.int64) * NUM_KV_HEADS * GROUP + heads) * max_tokens  # [BLOCK_G]
    for t0 in range(lo, hi, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        valid = tok < kv_len
        block = tl.load(table_ptr + start + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + tok % BLOCK_SIZE
        if CODEBOOK:  # [BLOCK_D, BLOCK_N] codebook levels (rows: (slot, head) rows of packed words)
            k = token_key_tile(
                k_ptr, codebook_ptr, slot * NUM_KV_HEADS + h, offs_d, valid, offs_d < HEAD_DIM,
                TURBOQUANT_ID, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE,
            )  # fmt: skip
        else:
            ptrs = k_ptr + (slot[None, :] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[:, None]  # [BLOCK_D, BLOCK_N]
            k = tl.load(ptrs, mask=valid[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        logit = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        if K_SCALE:
            logit = logit * tl.load(k_scale_ptr + slot * NUM_KV_HEADS + h, mask=valid, other=0.0)[None, :]
        logit = tl.where(valid[None, :], logit, float("-inf"))
        tl.store(out_rows[:, None] + tok[None, :], logit, mask=mask_g[:, None] & (tok[None, :] < hi))
    pdl_exit(USE_GDC)


paged_logits_kernel = Kernel(_paged_logits_kernel)


def paged_logits_triton(
    q, k_cache, table_indices, table_start, kv_lens, out, scale: float, k_scale=None, codebook=None
) -> torch.Tensor:
    """Inputs already validated by ``sparse_kernels.paged_logits``; ``out`` must be contiguous."""
    from sparse_kernels._triton.quantized_decode_launch import codebook_launch

    batch, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_tokens = out.shape[2]
    codebook, codes = codebook_launch(codebook, head_dim)
    if q.stride(2) != 1:
        q = q.contiguous()
    group = num_qo_heads // num_kv_heads
    config = CONFIG if k_scale is None else FP8_CONFIG
    block_n = config["BLOCK_N"]
    chunk = items_per_program(batch * num_kv_heads, max_tokens, block_n)
    # 16-bit dots when the query and the keys share a 16-bit dtype (fp8 codes: fp16, exact), fp32 otherwise.
    if k_scale is not None:
        dots = dot_args(torch.float16, q.device)
    else:
        dots = dot_args(k_cache.dtype if q.dtype == k_cache.dtype else torch.float32, q.device)
    paged_logits_kernel[(batch, num_kv_heads, triton.cdiv(max_tokens, chunk))](
        q,
        k_cache,
        k_cache if k_scale is None else k_scale,
        k_cache if codebook is None else codebook,
        table_indices,
        table_start,
        kv_lens,
        out,
        q.stride(0),
        q.stride(1),
        max_tokens,
        chunk,
        scale,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        K_SCALE=k_scale is not None,
        **codes,
        **dots,
        **pdl_args(q.device),
    )
    return out
