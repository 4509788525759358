"""The query-aware selection kernels as of commit 1a3af46 (before issue 17 item 3), kept only so that
``quest_select_probe.py`` can time the old kernels against the new ones on the same inputs. Not
imported by any package; inputs must be valid for ``sparse_kernels``' public wrappers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel

# --- _triton/page_bounds.py at 1a3af46

BLOCK_P = 32  # pages per program


def _page_bounds_kernel(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    table_ptr,
    start_ptr,
    num_pages_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    max_pages,
    sink,
    recent,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pages = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    start = tl.load(start_ptr + b).to(tl.int64)
    num_pages = tl.load(num_pages_ptr + b).to(tl.int64)
    valid = pages < num_pages
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    best = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    if tl.program_id(2) * BLOCK_P < num_pages:
        ids = tl.load(table_ptr + start + pages, mask=valid, other=0).to(tl.int64)
        rows = (ids * NUM_KV_HEADS + h) * HEAD_DIM
        m2 = valid[:, None] & dmask[None, :]
        lo = tl.load(kmin_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        hi = tl.load(kmax_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        for g in tl.static_range(GROUP):
            qh = tl.load(q_ptr + b * stride_qb + (h * GROUP + g) * stride_qh + offs_d, mask=dmask, other=0.0)
            qh = qh.to(tl.float32)
            bound = tl.sum(tl.maximum(qh, 0.0)[None, :] * hi + tl.minimum(qh, 0.0)[None, :] * lo, axis=1)
            best = tl.maximum(best, bound)
    forced = (pages < sink) | ((pages >= num_pages - recent) & valid)
    best = tl.where(forced, float("inf"), best)
    best = tl.where(valid, best, float("-inf"))
    tl.store(out_ptr + (b * NUM_KV_HEADS + h) * max_pages + pages, best, mask=pages < max_pages)


page_bounds_kernel = Kernel(_page_bounds_kernel)


def page_bounds_triton(
    q, kmin, kmax, table_indices, table_start, num_pages, out, sink: int, recent: int
) -> torch.Tensor:
    """Inputs already validated by ``sparse_kernels.page_bounds``; ``out`` must be contiguous."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    max_pages = out.shape[2]
    if q.stride(2) != 1:
        q = q.contiguous()
    page_bounds_kernel[(batch, num_kv_heads, triton.cdiv(max_pages, BLOCK_P))](
        q,
        kmin,
        kmax,
        table_indices,
        table_start,
        num_pages,
        out,
        q.stride(0),
        q.stride(1),
        max_pages,
        sink,
        recent,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_qo_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_P=BLOCK_P,
        num_warps=4,
    )
    return out


# --- _triton/paged_logits.py at 1a3af46

BLOCK_N = 64  # tokens per program


def _paged_logits_kernel(
    q_ptr,
    k_ptr,
    table_ptr,
    start_ptr,
    lens_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    max_tokens,
    scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tok = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(start_ptr + b).to(tl.int64)
    kv_len = tl.load(lens_ptr + b).to(tl.int64)
    valid = tok < kv_len
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    k = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if tl.program_id(2) * BLOCK_N < kv_len:
        block = tl.load(table_ptr + start + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + tok % BLOCK_SIZE
        ptrs = k_ptr + (slot[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
        k = tl.load(ptrs, mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    for g in tl.static_range(GROUP):
        hq = h * GROUP + g
        qh = tl.load(q_ptr + b * stride_qb + hq * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        logit = tl.sum(qh[None, :] * k, axis=1) * scale
        logit = tl.where(valid, logit, float("-inf"))
        tl.store(out_ptr + (b * NUM_KV_HEADS * GROUP + hq) * max_tokens + tok, logit, mask=tok < max_tokens)


paged_logits_kernel = Kernel(_paged_logits_kernel)


def paged_logits_triton(q, k_cache, table_indices, table_start, kv_lens, out, scale: float) -> torch.Tensor:
    """Inputs already validated by ``sparse_kernels.paged_logits``; ``out`` must be contiguous."""
    batch, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_tokens = out.shape[2]
    if q.stride(2) != 1:
        q = q.contiguous()
    paged_logits_kernel[(batch, num_kv_heads, triton.cdiv(max_tokens, BLOCK_N))](
        q,
        k_cache,
        table_indices,
        table_start,
        kv_lens,
        out,
        q.stride(0),
        q.stride(1),
        max_tokens,
        scale,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_qo_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=BLOCK_N,
        num_warps=4,
    )
    return out


# --- _triton/top_k_ascending.py at 1a3af46: the package's kernel is that one again (the radix select
# that replaced it measured slower and was reverted), so "old" top-k is imported, not copied.
from sparse_kernels._triton.top_k_ascending import top_k_ascending_triton  # noqa: E402, F401
