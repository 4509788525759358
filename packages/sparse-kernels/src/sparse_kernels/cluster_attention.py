"""RetroInfer's decode attention over a cluster index (plain torch, the reference the kernels follow).

Per KV head, the clusters are ranked by the group's query heads: softmax over the clusters of
``scale * q . centroid`` (empty clusters masked), summed over the group's query heads; the best
``retrieved`` are read exactly, the next ``estimated`` are estimated, the rest omitted. Each query
head then runs one softmax over

- every token read exactly: the sink ``[0, sink)``, the unindexed tokens ``[index.end, kv_len)``
  (the recent ones) and every token of the retrieved clusters, ``exp(scale * q . k) * v``;
- each estimated cluster as ``size`` tokens that all share the key ``centroid``: ``size *
  exp(scale * q . c)`` in the denominator and ``exp(scale * q . c) * value_sum`` in the numerator.

With every cluster retrieved this is dense attention.
"""

from __future__ import annotations

import torch

from sparse_kernels.cluster_estimation import cluster_estimation
from sparse_kernels.cluster_index import ClusterIndex
from sparse_kernels.merge_states import merge_states


def cluster_counts(num_clusters: int, retrieval_ratio: float, estimation_ratio: float) -> tuple[int, int]:
    """``(retrieved, estimated)``: ``clamp(round(C * r), 1, C)`` and ``min(round(C * e), C - retrieved)``."""
    retrieved = min(max(round(num_clusters * retrieval_ratio), 1), num_clusters)
    return retrieved, min(round(num_clusters * estimation_ratio), num_clusters - retrieved)


def rank_clusters(query: torch.Tensor, index: ClusterIndex, scale: float, top: int) -> torch.Tensor:
    """``[H, top]`` int64 cluster ids per KV head, best first, for one decode query ``[Hq, D]``."""
    heads, count, dim = index.centroids.shape
    q = query.float().view(heads, -1, dim)
    logits = torch.bmm(q, index.centroids.float().transpose(1, 2)) * scale  # [H, g, C]
    logits = logits.masked_fill((index.sizes == 0).unsqueeze(1), float("-inf"))
    scores = torch.softmax(logits, dim=-1).sum(dim=1)
    return torch.topk(scores, min(top, count), dim=-1).indices


def exact_positions(index: ClusterIndex, retrieved: torch.Tensor, head: int, *, sink: int, kv_len: int) -> torch.Tensor:
    """Ascending positions KV head ``head`` reads exactly: sink, retrieved clusters, unindexed tail."""
    device = index.centroids.device
    return torch.cat(
        [
            torch.arange(min(sink, index.start), device=device),
            index.cluster_positions(head, retrieved),
            torch.arange(index.end, kv_len, device=device),
        ]
    )


def cluster_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: ClusterIndex,
    *,
    sink: int,
    retrieved: int,
    estimated: int,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention output ``[Hq, D]`` (query's dtype) of one decode query ``[Hq, D]`` over a layer's
    ``keys`` / ``values`` ``[kv_len, H, D]`` through ``index``: the exact tokens' softmax merged with
    the estimated clusters' (``cluster_estimation``, on ``backend``), i.e. one softmax over both."""
    if estimated and index.value_sums is None:
        raise ValueError("estimating clusters needs an index built with values (value_sums)")
    heads, _, dim = index.centroids.shape
    group = query.shape[0] // heads
    ranked = rank_clusters(query, index, scale, retrieved + estimated)
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.empty(query.shape[0], dtype=torch.float32, device=query.device)
    for h in range(heads):
        q = query[h * group : (h + 1) * group].float()
        pos = exact_positions(index, ranked[h, :retrieved], h, sink=sink, kv_len=keys.shape[0])
        logits = q @ keys[pos, h].float().T * scale  # [g, n]
        lse[h * group : (h + 1) * group] = torch.logsumexp(logits, dim=-1)
        out[h * group : (h + 1) * group] = torch.softmax(logits, dim=-1) @ values[pos, h].float()
    if ranked.shape[1] > retrieved:
        est_out, est_lse = cluster_estimation(
            query[None],
            index.centroids,
            index.value_sums,
            index.sizes,
            ranked[None, :, retrieved:],
            scale=scale,
            backend=backend,
        )
        out = merge_states(out, lse, est_out[0], est_lse[0])
    return out.to(query.dtype)
