"""Triton ``cluster_estimation``, split-K: program ``(row, KV head, split)`` runs an online softmax over one
slice of the row's estimated clusters for all query heads of the group at once (each cluster's data is read
once per group), each cluster weighted by its size (``s + log(size)``); a second kernel merges the splits'
``(out, lse)`` per query head.

Per tile of clusters the scores come either from the centroids (``FROM_LOGITS`` off, the reference path: the
query is loaded once, and a ``tl.dot`` of it with a ``[D, BLOCK_E]`` centroid tile in the centroids' dtype)
or from the ranking's logits (``FROM_LOGITS``: a ``[BLOCK_G, BLOCK_E]`` tile of ``cluster_logits``' float32
logits at the clusters' columns ``id - base``, times ``scale / logits_scale``; the query and the centroids are
not read). The ranking computed those products already for every column of the row, so the centroid's 256
bytes (bf16, D = 128) per cluster become the group's G logits (16 bytes at G = 4, though a cluster's logits lie
one row of columns apart, in separate sectors, and were written by the ranking just before, likely still in
L2); the value sums stay (the arena's: bf16 for a bf16 model, 256 bytes; float32 512), converted to float32
as they load, in one TF32 ``tl.dot`` with the weights.

The split count fills the GPU (``PROGRAMS_PER_SM`` programs per multiprocessor over ``rows x KV heads``
lists), and depends only on the shapes, so a CUDA graph captures one grid. On the H200 at batch 5 / 128K
(~1.9K estimated clusters per row and KV head), per step of 36 layers: one program per (row, query head)
12.5 ms (latency-bound); split, with broadcast-and-sum products instead of ``tl.dot``, 6.8 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._decode_buffers import num_sms
from sparse_kernels._triton.launch import Kernel, dot_args, pdl_args, pdl_enter, pdl_exit

BLOCK_E = 32  # clusters per tile
PROGRAMS_PER_SM = 8
# On the H200 at batch 5 / 128K, per layer (``benchmarks/retroinfer_kernel_probe.py``, session 12): value sums
# in one TF32 product with 2 stages 27.6 us, against 40.9 us in three (tf32x3) at Triton's default stages; the
# output moved by at most 8e-6 (it is merged into a bf16 attention output). Session 16: one warp a program, 8
# programs per multiprocessor, 25.1 us against 27.6 for 4 warps at 4 per SM (2 warps at 8: 36.6; one warp at 16:
# 29.2); in the engine 1.10 -> 1.02 ms of estimation per step (results/bench/h200/session16/retro_tq_c6/).
# Session 21 (the loads depend on the ids alone; engine-like ids in column order, bf16 value sums, scores from the
# logits): one stage 16.9 us against 21.3 for two and 25.8 for three, 32 clusters a tile and 8 programs per SM
# best of 54 shapes (16 to 128 clusters, 1 to 4 warps, 8 to 64 programs per SM); the indirect loads gain nothing
# from the pipeliner's buffers. In the engine 0.774 -> 0.705 ms a step with the merge.
NUM_WARPS = 1
NUM_STAGES = 1
VALUE_PRECISION = "tf32"  # on CUDA; the interpreter computes in IEEE float32


def _cluster_estimation_split_kernel(
    q_ptr, c_ptr, logits_ptr, base_ptr, vs_ptr, size_ptr, ids_ptr, o_part_ptr, lse_part_ptr, scale, num_clusters,
    num_columns, num_est, chunk, num_splits, dim,
    HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, VALUE_PRECISION: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    """``scale`` multiplies ``q . centroid``, or with ``FROM_LOGITS`` the logits (``[rows, HEADS, GROUP,
    num_columns]``, row ``b``'s column of cluster ``id`` is ``id - base_ptr[b]``; ``q_ptr`` / ``c_ptr`` unread)."""
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    heads = kv * GROUP + g  # this group's query heads
    if FROM_LOGITS:
        base = tl.load(base_ptr + b)
        logit_rows = ((b * HEADS + kv) * GROUP + g) * num_columns  # [BLOCK_G] this group's logits rows
    else:
        q = tl.load(
            q_ptr + (b * (HEADS * GROUP) + heads)[:, None] * dim + d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_G, D] (rows past the group are zero)
    m = tl.full([BLOCK_G], -1e30, tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, num_est)
    for start in range(lo, hi, BLOCK_E):
        e = start + tl.arange(0, BLOCK_E)
        ids = tl.load(ids_ptr + (b * HEADS + kv) * num_est + e, mask=e < hi, other=-1)
        valid = ids >= 0
        if FROM_LOGITS:
            col = ids - base
            valid = valid & (col >= 0) & (col < num_columns)
        row = kv * num_clusters + tl.where(valid, ids, 0)
        # Every load below depends on the ids alone (not on the sizes), so the three are in flight together;
        # an empty cluster (size 0) is read like any other and dropped after.
        size = tl.load(size_ptr + row, mask=valid, other=0).to(tl.float32)
        if FROM_LOGITS:
            s = tl.load(
                logits_ptr + logit_rows[:, None] + tl.where(valid, col, 0)[None, :],
                mask=gmask[:, None] & valid[None, :],
                other=float("-inf"),
            )  # float32 [BLOCK_G, E]; -inf (past a row's count) stays -inf
            s = s * scale
        else:
            c = tl.load(c_ptr + row[None, :] * dim + d[:, None], mask=valid[None, :] & dmask[:, None], other=0.0)
            s = tl.dot(q, c.to(DOT_DTYPE), input_precision=PRECISION) * scale  # float32 [BLOCK_G, E]
        v = tl.load(vs_ptr + row[:, None] * dim + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0).to(
            tl.float32
        )  # [E, D], stored float32 or 16-bit
        valid = valid & (size > 0)
        v = tl.where(valid[:, None], v, 0.0)  # an empty cluster's row may hold anything
        s = tl.where(valid[None, :], s + tl.log(tl.maximum(size, 1.0))[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])  # size * exp(q.c - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        w = p / tl.maximum(size, 1.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(w, v, input_precision=VALUE_PRECISION)  # float32 value sums
        m = m_new
    empty = denom == 0.0
    part = (b * (HEADS * GROUP) + heads) * num_splits + split  # [G]
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    tl.store(o_part_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_part_ptr + part, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, denom))), mask=gmask)
    pdl_exit(USE_GDC)


def _cluster_estimation_merge_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, num_splits, dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_GDC)  # the step's earlier kernels write what it reads
    r = tl.program_id(0).to(tl.int64)  # row * query heads + query head
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    lse = tl.load(lse_part_ptr + r * num_splits + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)  # 0 for splits that estimated nothing
    denom = tl.sum(w, axis=0)
    o = tl.load(
        o_part_ptr + (r * num_splits + s)[:, None] * BLOCK_D + d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    empty = denom == 0.0
    o = tl.sum(o * w[:, None], axis=0) / tl.where(empty, 1.0, denom)
    tl.store(out_ptr + r * dim + d, o, mask=dmask)
    tl.store(lse_ptr + r, tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, denom))))
    pdl_exit(USE_GDC)


cluster_estimation_split_kernel = Kernel(_cluster_estimation_split_kernel)
cluster_estimation_merge_kernel = Kernel(_cluster_estimation_merge_kernel)


def estimation_splits(batch: int, heads: int, num_est: int, device: torch.device) -> int:
    """Splits per (row, KV head): enough programs to fill the device, at most one per tile of clusters."""
    want = -(-PROGRAMS_PER_SM * num_sms(device) // max(1, batch * heads))
    return max(1, min(want, triton.cdiv(num_est, BLOCK_E)))


def cluster_estimation_triton(
    query, centroids, value_sums, sizes, clusters, scale: float, logits=None, bases=None, partial: bool = False
):
    """``scale`` multiplies ``q . centroid``, or, given ``logits`` (and the rows' ``bases``), the logits.
    ``partial``: the splits' states ``[B, Hq, S, D]`` / ``[B, Hq, S]`` (views of the split kernel's output),
    without the merge launch."""
    batch, q_heads, dim = query.shape
    heads, count, _ = centroids.shape
    num_est = clusters.shape[2]
    splits = estimation_splits(batch, heads, num_est, query.device)
    chunk = triton.cdiv(triton.cdiv(num_est, splits), BLOCK_E) * BLOCK_E
    group, block_d = q_heads // heads, max(16, triton.next_power_of_2(dim))
    o_part = torch.empty(batch * q_heads * splits, block_d, dtype=torch.float32, device=query.device)
    lse_part = torch.empty(batch * q_heads * splits, dtype=torch.float32, device=query.device)
    query, centroids = query.contiguous(), centroids.contiguous()
    from_logits = logits is not None
    if from_logits:
        logits, bases = logits.contiguous(), bases.to(torch.int64).contiguous()
    cluster_estimation_split_kernel[(batch, heads, splits)](
        query,
        centroids,
        logits if from_logits else query,  # unread without logits
        bases if from_logits else clusters,
        value_sums.contiguous(),
        sizes.to(torch.int32).contiguous(),
        clusters.to(torch.int64).contiguous(),
        o_part,
        lse_part,
        float(scale),
        count,
        logits.shape[-1] if from_logits else 0,
        num_est,
        chunk,
        splits,
        dim,
        HEADS=heads,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_E=BLOCK_E,
        BLOCK_D=block_d,
        **dot_args(centroids.dtype if query.dtype == centroids.dtype else torch.float32, query.device),
        VALUE_PRECISION="ieee" if query.device.type == "cpu" else VALUE_PRECISION,
        FROM_LOGITS=from_logits,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        **pdl_args(query.device),
    )
    if partial:
        return o_part.view(batch, q_heads, splits, block_d)[..., :dim], lse_part.view(batch, q_heads, splits)
    out = torch.empty(batch, q_heads, dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=query.device)
    cluster_estimation_merge_kernel[(batch * q_heads,)](
        o_part,
        lse_part,
        out,
        lse,
        splits,
        dim,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        num_warps=4,
        **pdl_args(query.device),
    )
    return out, lse
