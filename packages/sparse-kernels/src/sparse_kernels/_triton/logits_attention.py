"""Triton ``softmax_stats`` (one program per row, online over tiles) and ``logits_attention`` (split-K
over tokens: program ``(b, h, s)`` reads chunk ``s`` of row ``b``'s values for KV head ``h`` once for
all its query heads, then a reduce sums the chunks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._decode_buffers import num_sms
from sparse_kernels._triton.launch import Kernel, dot_args, pdl_args, pdl_enter, pdl_exit
from sparse_kernels._triton.quantized_tiles import TURBOQUANT_ID, token_value_tile

STATS_BLOCK = 4096  # columns per step of softmax_stats
MAX_SPLITS = 64
# logits_attention's launch: tokens per inner step, warps, pipeline stages and programs per SM, for model-dtype
# values and for codes with per-token scales, fp8 or TurboQuant (benchmarks/logits_fp8_probe.py sweeps both).
# Session 17 on the H200, one layer of Qwen3-8B at 128K, batch 5 / 11: one-warp programs of 32 tokens, 16 per
# SM, bf16 455.7 / 928.6 -> 345.0 / 715.5 us, fp8 741.8 / 1321.1 -> 339.3 / 695.7 us (the old shape was 64
# tokens, 4 warps, 8 per SM).
CONFIG = {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16}
FP8_CONFIG = {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16}


def _softmax_stats_kernel(x_ptr, max_ptr, sum_ptr, width, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, width, BLOCK):
        cols = start + offs
        x = tl.load(x_ptr + row * width + cols, mask=cols < width, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing finite yet: keep s = 0
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    pdl_exit(USE_GDC)


def _logits_attention_split_kernel(
    logits_ptr,
    lse_ptr,
    v_ptr,
    v_scale_ptr,
    codebook_ptr,
    table_ptr,
    start_ptr,
    lens_ptr,
    part_ptr,
    width,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    V_SCALE: tl.constexpr,
    CODEBOOK: tl.constexpr,
    BITS: tl.constexpr,
    CPW: tl.constexpr,
    WORDS: tl.constexpr,
    UNPACK_WORDS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(start_ptr + b).to(tl.int64)
    kv_len = tl.load(lens_ptr + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = b * (NUM_KV_HEADS * GROUP) + h * GROUP + offs_g  # rows of logits / lse
    lse = tl.load(lse_ptr + heads, mask=mask_g, other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(lo, hi, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        block = tl.load(table_ptr + start + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + offs_n % BLOCK_SIZE
        if CODEBOOK:  # [BLOCK_N, BLOCK_D] codebook levels of TurboQuant's packed indices
            v = token_value_tile(
                v_ptr, codebook_ptr, slot * NUM_KV_HEADS + h, offs_d, mask_n, mask_d,
                TURBOQUANT_ID, BITS, CPW, WORDS, BLOCK_D, BLOCK_N, UNPACK_WORDS, DOT_DTYPE,
            )  # fmt: skip
        else:
            v = tl.load(
                v_ptr + (slot * NUM_KV_HEADS + h)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
        x = tl.load(
            logits_ptr + heads[:, None] * width + offs_n[None, :],
            mask=mask_g[:, None] & mask_n[None, :],
            other=float("-inf"),
        )
        p = tl.exp(x - lse[:, None])  # [BLOCK_G, BLOCK_N], 0 where masked
        if V_SCALE:  # fp8 codes: each value's scale folded into its probability
            p = p * tl.load(v_scale_ptr + slot * NUM_KV_HEADS + h, mask=mask_n, other=0.0)[None, :]
        acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    rows = heads * num_splits + split
    tl.store(part_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])
    pdl_exit(USE_GDC)


def _logits_attention_reduce_kernel(
    part_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_qo_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (b * num_qo_heads + hq) * num_splits + offs_s
    part = tl.load(
        part_ptr + rows[:, None] * BLOCK_D + offs_d[None, :],
        mask=(offs_s < num_splits)[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    o = tl.sum(part, axis=0)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    pdl_exit(USE_GDC)


softmax_stats_kernel = Kernel(_softmax_stats_kernel)
logits_attention_split_kernel = Kernel(_logits_attention_split_kernel)
logits_attention_reduce_kernel = Kernel(_logits_attention_reduce_kernel)


def softmax_stats_triton(logits: torch.Tensor, out_max: torch.Tensor, out_sum: torch.Tensor) -> None:
    rows, width = logits.shape
    block = min(STATS_BLOCK, max(16, triton.next_power_of_2(width)))
    softmax_stats_kernel[(rows,)](logits, out_max, out_sum, width, BLOCK=block, num_warps=8, **pdl_args(logits.device))


def num_splits(batch: int, num_kv_heads: int, device: torch.device, programs_per_sm: int = 8) -> int:
    """Token chunks per (row, KV head): about ``programs_per_sm`` programs per SM (a function of the batch)."""
    return max(1, min(MAX_SPLITS, -(-programs_per_sm * num_sms(device) // (batch * num_kv_heads))))


def logits_attention_triton(
    logits, logit_lse, v_cache, table_indices, table_start, kv_lens, out, v_scale=None, codebook=None
):
    from sparse_kernels._triton.quantized_decode_launch import codebook_launch

    batch, num_qo_heads, width = logits.shape
    _, block_size, num_kv_heads, _ = v_cache.shape
    head_dim = out.shape[-1]
    codebook, codes = codebook_launch(codebook, head_dim)
    group = num_qo_heads // num_kv_heads
    config = CONFIG if v_scale is None else FP8_CONFIG
    splits = num_splits(batch, num_kv_heads, logits.device, config["programs_per_sm"])
    block_d = max(16, triton.next_power_of_2(head_dim))
    part = torch.empty(batch * num_qo_heads * splits * block_d, dtype=torch.float32, device=logits.device)
    logits_attention_split_kernel[(batch, num_kv_heads, splits)](
        logits,
        logit_lse,
        v_cache,
        v_cache if v_scale is None else v_scale,
        v_cache if codebook is None else codebook,
        table_indices,
        table_start,
        kv_lens,
        part,
        width,
        splits,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=config["BLOCK_N"],
        **dot_args(torch.float16 if v_scale is not None else v_cache.dtype, v_cache.device),  # fp8 codes: fp16 dots
        V_SCALE=v_scale is not None,
        **codes,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **pdl_args(v_cache.device),
    )
    logits_attention_reduce_kernel[(batch, num_qo_heads)](
        part,
        out,
        out.stride(0),
        out.stride(1),
        num_qo_heads,
        splits,
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        BLOCK_D=block_d,
        num_warps=4,
        **pdl_args(out.device),
    )
    return out
