"""RetroInfer's decode attention over a cluster index (plain torch, the reference the kernels follow).

Per KV head, the clusters are ranked by the group's query heads: softmax over the clusters of
``scale * q . centroid`` (empty clusters masked), summed over the group's query heads (a stable sort:
ties to the lower cluster, empty clusters last); the best ``retrieved`` are read exactly, the next
``estimated`` are estimated, the rest omitted. A token ``budget`` instead reads, per KV head, the first
``budget`` tokens of the clusters in the selection's order (``cluster_select``: the retrieved in rank order,
then the estimated and then the rest, each part in cluster order; each cluster's tokens in index order; the
last cluster reached is cut short and its remaining tokens omitted), as an engine whose reads have a fixed
width does; the clusters among the best ``retrieved + estimated`` it does not reach are estimated. Each query
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
from sparse_kernels.cluster_select import selection_layout
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
    empty = index.sizes == 0
    logits = logits.masked_fill(empty.unsqueeze(1), float("-inf"))
    scores = torch.softmax(logits, dim=-1).sum(dim=1).nan_to_num(nan=0.0).masked_fill(empty, float("-inf"))
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(top, count)]


def exact_positions(index: ClusterIndex, retrieved: torch.Tensor, head: int, *, sink: int, kv_len: int) -> torch.Tensor:
    """Ascending positions KV head ``head`` reads exactly: sink, retrieved clusters, unindexed tail."""
    return _with_sink_and_tail(index, index.cluster_positions(head, retrieved), sink=sink, kv_len=kv_len)


def budget_positions(index: ClusterIndex, ranked: torch.Tensor, head: int, budget: int) -> tuple[torch.Tensor, int]:
    """The first ``budget`` tokens of the clusters ``ranked`` (int64 ``[k]``, best first) of KV head ``head``,
    each cluster's in index order, ascending; and how many places of ``ranked`` they reach (an empty cluster
    counts when the budget reaches its place)."""
    offsets, sizes = index.offsets[head, ranked].tolist(), index.sizes[head, ranked].tolist()
    parts, reached, taken = [], 0, 0
    for o, n in zip(offsets, sizes, strict=True):
        if taken >= budget:
            break
        if n:
            parts.append(index.sorted_positions[head, o : o + min(n, budget - taken)])
        reached, taken = reached + 1, taken + n
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=index.centroids.device), reached
    return torch.cat(parts).to(torch.int64).sort().values, reached


def _with_sink_and_tail(index: ClusterIndex, middle: torch.Tensor, *, sink: int, kv_len: int) -> torch.Tensor:
    device = index.centroids.device
    return torch.cat(
        [torch.arange(min(sink, index.start), device=device), middle, torch.arange(index.end, kv_len, device=device)]
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
    budget: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention output ``[Hq, D]`` (query's dtype) of one decode query ``[Hq, D]`` over a layer's
    ``keys`` / ``values`` ``[kv_len, H, D]`` through ``index``: the exact tokens' softmax merged with
    the estimated clusters' (``cluster_estimation``, on ``backend``), i.e. one softmax over both.
    ``budget`` (None: ``retrieved`` whole clusters) reads that many cluster tokens per KV head in the selection's
    order instead (module docstring); per head the best ``retrieved + estimated`` not read are estimated (none
    when ``estimated`` is 0)."""
    if estimated and index.value_sums is None:
        raise ValueError("estimating clusters needs an index built with values (value_sums)")
    heads, count, dim = index.centroids.shape
    group = query.shape[0] // heads
    ranked = rank_clusters(query, index, scale, count)
    if budget is not None:  # read in the selection's order
        k = [min(retrieved, count), min(retrieved + estimated, count)]
        ranked = selection_layout(ranked[None], *torch.tensor(k, device=ranked.device)[:, None])[0]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.empty(query.shape[0], dtype=torch.float32, device=query.device)
    est = torch.full((heads, max(retrieved + estimated, 1)), -1, dtype=torch.int64, device=query.device)
    for h in range(heads):
        q = query[h * group : (h + 1) * group].float()
        if budget is None:
            read, middle = retrieved, index.cluster_positions(h, ranked[h, :retrieved])
        else:
            middle, read = budget_positions(index, ranked[h], h, budget)
        pos = _with_sink_and_tail(index, middle, sink=sink, kv_len=keys.shape[0])
        logits = q @ keys[pos, h].float().T * scale  # [g, n]
        lse[h * group : (h + 1) * group] = torch.logsumexp(logits, dim=-1)
        out[h * group : (h + 1) * group] = torch.softmax(logits, dim=-1) @ values[pos, h].float()
        ids = ranked[h, read : retrieved + estimated]
        est[h, : ids.numel()] = ids
    if estimated:  # (without estimation, retrieved clusters past the budget are omitted)
        est_out, est_lse = cluster_estimation(
            query[None], index.centroids, index.value_sums, index.sizes, est[None], scale=scale, backend=backend
        )
        out = merge_states(out, lse, est_out[0], est_lse[0])
    return out.to(query.dtype)
