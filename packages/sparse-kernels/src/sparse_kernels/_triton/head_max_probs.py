"""Triton ``head_max_probs``: one program per (row, tile of tokens), looping over the query heads."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

BLOCK = 1024  # tokens per program


def _head_max_probs_kernel(
    logits_ptr,
    lse_ptr,
    lens_ptr,
    out_ptr,
    width,
    sink,
    recent,
    HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    kv_len = tl.load(lens_ptr + b).to(tl.int64)
    valid = offs < kv_len
    best = tl.zeros([BLOCK], tl.float32)
    for h in range(HEADS):
        lse = tl.load(lse_ptr + b * HEADS + h)
        x = tl.load(logits_ptr + (b * HEADS + h) * width + offs, mask=valid, other=float("-inf"))
        best = tl.maximum(best, tl.exp(x - lse))
    forced = (offs < sink) | ((offs >= kv_len - recent) & valid)
    best = tl.where(forced, float("inf"), best)
    best = tl.where(valid, best, float("-inf"))
    tl.store(out_ptr + b * width + offs, best, mask=offs < width)
    pdl_exit(USE_GDC)


head_max_probs_kernel = Kernel(_head_max_probs_kernel)


def head_max_probs_triton(logits, logit_lse, kv_lens, out, sink: int, recent: int):
    batch, heads, width = logits.shape
    block = min(BLOCK, max(16, triton.next_power_of_2(width)))
    head_max_probs_kernel[(batch, triton.cdiv(width, block))](
        logits,
        logit_lse,
        kv_lens,
        out,
        width,
        sink,
        recent,
        HEADS=heads,
        BLOCK=block,
        num_warps=4,
        **pdl_args(out.device),
    )
    return out
