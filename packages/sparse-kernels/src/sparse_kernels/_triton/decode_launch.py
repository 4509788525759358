"""Host side of the Triton split-K decode: pick constexprs and launch split, reduce and scores passes."""

from __future__ import annotations

import os

import torch
import triton

from sparse_kernels._decode_buffers import DecodeBuffers
from sparse_kernels._decode_layout import DecodeLayout
from sparse_kernels._triton.decode import decode_reduce_kernel, decode_scores_kernel, decode_split_kernel
from sparse_kernels._triton.launch import dot_args, pdl_args

LOG2_E = 1.4426950408889634
# Tokens per inner step and launch shape of the split / scores passes: the best of a sweep over
# BLOCK_N {32, 64, 128} x warps {4, 8} x stages {2, 3} on an H200, bf16, D=128 (benchmarks/NOTES.md).
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
# The split kernel merges its partials itself (no reduce launch) up to this many splits; 0: always two
# launches. MERGE_SPLITS: partials the in-kernel merge loads at once (more in flight, more registers).
# H200 (decode_bandwidth.py --reduce-compare, us per layer, two-launch -> fused with merge 4 / 8 / 16):
# batch 5 at 8K (27 splits) 49.9 -> 52.7 / 53.2 / 58.4; batch 5 at 128K (27) 630.6 -> 633.4 / 722.6 / 651.7;
# batch 1 at 32K (64) 41.1 -> 44.4 / 45.0 / 56.0; batch 91 at 8K (2 splits) 788.4 -> 788.8 / 710.6 / 750.8.
# The merge never won with many splits and its gain at 2 splits swings with the compile, so two launches
# stay the default until an engine-level A/B says otherwise (SPARSE_KERNELS_FUSED_REDUCE_MAX_SPLITS).
FUSED_REDUCE_MAX_SPLITS = int(os.environ.get("SPARSE_KERNELS_FUSED_REDUCE_MAX_SPLITS", "0"))
MERGE_SPLITS = 8


def fused_reduce(num_splits: int) -> bool:
    """Whether a launch of ``num_splits`` splits merges in the split kernel (fixed per batch size)."""
    return num_splits <= FUSED_REDUCE_MAX_SPLITS


def run_decode_triton(
    layout: DecodeLayout,
    bufs: DecodeBuffers,
    num_splits: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scores_out: torch.Tensor | None,
) -> torch.Tensor:
    """Inputs checked by the wrapper; ``bufs`` holds this plan's metadata and enough scratch."""
    q = q.to(k_cache.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    block_n = DECODE_CONFIG["BLOCK_N"]
    launch = {"num_warps": DECODE_CONFIG["num_warps"], "num_stages": DECODE_CONFIG["num_stages"]}
    shape = {
        "NUM_KV_HEADS": layout.num_kv_heads,
        "GROUP": layout.group,
        "HEAD_DIM": layout.head_dim,
        "PAGE_SIZE": layout.page_size,
        "HEAD_SPARSE": layout.head_sparse,
        "WINDOW": layout.window_left >= 0,
        "BLOCK_D": max(16, triton.next_power_of_2(layout.head_dim)),
        "BLOCK_N": block_n,
    }
    block_g = max(16, triton.next_power_of_2(layout.group))  # tl.dot needs M >= 16
    dots = dot_args(k_cache.dtype, k_cache.device)
    scale_log2 = layout.sm_scale * LOG2_E
    window_left = max(layout.window_left, 0)
    grid = (layout.batch, layout.num_kv_heads, num_splits)
    fused = fused_reduce(num_splits)
    decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        bufs.indptr,
        bufs.indices,
        bufs.last_len,
        bufs.o_part,
        bufs.lse_part,
        out,
        bufs.lse,
        bufs.arrivals,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        scale_log2,
        num_splits,
        window_left,
        FUSED=fused,
        BLOCK_G=block_g,
        BLOCK_H=triton.next_power_of_2(layout.group),
        MERGE_UNROLL=MERGE_SPLITS,  # not tied to num_splits: one compile serves every batch size
        **shape,
        **dots,
        **launch,
        **pdl_args(q.device),
    )
    if not fused:
        decode_reduce_kernel[(layout.batch, layout.num_qo_heads)](
            bufs.o_part,
            bufs.lse_part,
            bufs.indptr,
            bufs.last_len,
            out,
            bufs.lse,
            out.stride(0),
            out.stride(1),
            num_splits,
            window_left,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            **shape,
            num_warps=4,
            **pdl_args(q.device),
        )
    if scores_out is not None:
        decode_scores_kernel[grid](
            q,
            k_cache,
            bufs.indptr,
            bufs.indices,
            bufs.last_len,
            bufs.lse,
            scores_out,
            q.stride(0),
            q.stride(1),
            0 if layout.head_sparse else scores_out.stride(0),
            scale_log2,
            num_splits,
            window_left,
            BLOCK_G=block_g,
            BLOCK_PAGE=max(2, triton.next_power_of_2(layout.page_size)),
            **shape,
            **dots,
            **launch,
        )
    return out
