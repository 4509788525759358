"""Triton ``cluster_estimation``: one program per (row, query head), an online softmax over tiles of
the row's estimated clusters, each weighted by its size (``s + log(size)``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel

BLOCK_E = 32  # clusters per tile


def _cluster_estimation_kernel(
    q_ptr, c_ptr, vs_ptr, size_ptr, ids_ptr, out_ptr, lse_ptr, scale, num_clusters, num_est, dim,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv = (h // GROUP).to(tl.int64)
    HEADS: tl.constexpr = Q_HEADS // GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    q = tl.load(q_ptr + (b * Q_HEADS + h) * dim + d, mask=dmask, other=0.0).to(tl.float32)
    m = tl.max(tl.full([BLOCK_E], -1e30, tl.float32), axis=0)
    denom = tl.sum(tl.zeros([BLOCK_E], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for lo in range(0, num_est, BLOCK_E):
        e = lo + tl.arange(0, BLOCK_E)
        ids = tl.load(ids_ptr + (b * HEADS + kv) * num_est + e, mask=e < num_est, other=-1)
        valid = ids >= 0
        row = kv * num_clusters + tl.where(valid, ids, 0)
        size = tl.load(size_ptr + row, mask=valid, other=0).to(tl.float32)
        valid = valid & (size > 0)
        tile = row[:, None] * dim + d[None, :]
        both = valid[:, None] & dmask[None, :]
        c = tl.load(c_ptr + tile, mask=both, other=0.0).to(tl.float32)
        s = tl.sum(c * q[None, :], axis=1) * scale + tl.log(tl.maximum(size, 1.0))
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)  # size * exp(q.c - m_new)
        v = tl.load(vs_ptr + tile, mask=both, other=0.0)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum((p / tl.maximum(size, 1.0))[:, None] * v, axis=0)
        m = m_new
    empty = denom == 0.0
    tl.store(out_ptr + (b * Q_HEADS + h) * dim + d, tl.where(empty, 0.0, acc / tl.where(empty, 1.0, denom)), mask=dmask)
    tl.store(lse_ptr + b * Q_HEADS + h, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, denom))))


cluster_estimation_kernel = Kernel(_cluster_estimation_kernel)


def cluster_estimation_triton(query, centroids, value_sums, sizes, clusters, scale: float):
    batch, q_heads, dim = query.shape
    heads, count, _ = centroids.shape
    out = torch.empty(batch, q_heads, dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=query.device)
    cluster_estimation_kernel[(batch, q_heads)](
        query.contiguous(),
        centroids.contiguous(),
        value_sums.contiguous(),
        sizes.to(torch.int32).contiguous(),
        clusters.to(torch.int64).contiguous(),
        out,
        lse,
        float(scale),
        count,
        clusters.shape[2],
        dim,
        Q_HEADS=q_heads,
        GROUP=q_heads // heads,
        BLOCK_E=BLOCK_E,
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=4,
    )
    return out, lse
