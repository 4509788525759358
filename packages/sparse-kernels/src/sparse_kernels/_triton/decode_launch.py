"""Host side of the Triton split-K decode: pick constexprs and launch split, reduce and scores passes."""

from __future__ import annotations

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
# The same split kernel writing every token's logits (``logits_out``): its own launch shape, swept separately
# (``decode_bandwidth.py --logits``, 33 shapes at 128K x 5 on an H200, session 19): 32 tokens a step in 2 warps
# 749 us a layer against 907 with DECODE_CONFIG's shape (the plain decode: 632).
LOGITS_DECODE_CONFIG = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2}


def run_decode_triton(
    layout: DecodeLayout,
    bufs: DecodeBuffers,
    num_splits: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scores_out: torch.Tensor | None,
    logits_out: torch.Tensor | None = None,
    merge_with: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Inputs checked by the wrapper; ``bufs`` holds this plan's metadata and enough scratch. ``logits_out``:
    float32 ``[B, Hq, W]`` (dense lists), each token's raw logit written by the split kernel. ``merge_with``:
    other keys' states merged by the reduce (``launch_reduce``)."""
    q = q.to(k_cache.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    config = DECODE_CONFIG if logits_out is None else LOGITS_DECODE_CONFIG
    block_n = config["BLOCK_N"]
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
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
    decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        bufs.indptr,
        bufs.indices,
        bufs.last_len,
        bufs.o_part,
        bufs.lse_part,
        logits_out if logits_out is not None else bufs.lse_part,
        q.stride(0),
        q.stride(1),
        *logits_strides(logits_out),
        scale_log2,
        num_splits,
        window_left,
        LOGITS=logits_out is not None,
        BLOCK_G=block_g,
        **shape,
        **dots,
        **launch,
        **pdl_args(q.device),
    )
    launch_reduce(layout, bufs, num_splits, out, window_left, shape, merge_with)
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


def logits_strides(logits_out: torch.Tensor | None) -> tuple[int, int]:
    """``logits_out``'s (batch, head) strides for the split kernels' logits store (0, 0 without one)."""
    return (0, 0) if logits_out is None else (logits_out.stride(0), logits_out.stride(1))


def launch_reduce(
    layout: DecodeLayout,
    bufs: DecodeBuffers,
    num_splits: int,
    out: torch.Tensor,
    window_left: int,
    shape: dict,
    merge_with: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The reduce that merges the split kernel's partials into ``out`` and ``bufs.lse`` (bf16 and quantized
    decode alike); ``shape``: the split launch's static parameters, ``WINDOW`` included. ``merge_with``:
    ``(out [B, Hq, S, D] float32, unit stride on D; lse [B, Hq, S] float32 natural, contiguous)``, states over
    other keys merged in the same softmax (``BatchDecodeWithPagedKVCache.run``)."""
    x_out, x_lse = merge_with if merge_with is not None else (bufs.o_part, bufs.lse_part)
    x_splits = x_lse.shape[-1] if merge_with is not None else 1
    x_strides = x_out.stride()[:3] if merge_with is not None else (0, 0, 0)
    decode_reduce_kernel[(layout.batch, layout.num_qo_heads)](
        bufs.o_part,
        bufs.lse_part,
        bufs.indptr,
        bufs.last_len,
        out,
        bufs.lse,
        x_out,
        x_lse,
        out.stride(0),
        out.stride(1),
        *x_strides,
        num_splits,
        x_splits,
        window_left,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        **shape,
        EXTRA=merge_with is not None,
        BLOCK_X=max(2, triton.next_power_of_2(x_splits)),
        num_warps=4,
        **pdl_args(out.device),
    )
