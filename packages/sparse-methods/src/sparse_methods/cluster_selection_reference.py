"""The plain reference of ``cluster_selection``: RetroInfer's decode selection over a ``ClusterArena`` by a
full stable sort of every row's clusters and per-token tensors of the whole context (``[n, H, tokens_w]``).

It is the implementation the engine ran first, kept as the oracle that ``tests/test_cluster_selection.py``
holds the fast path equal to: the same ranking (the retrieved clusters in order, the estimated as a set), the
same slots and the same estimated clusters. Its cost grows with the context (a float32 copy of the centroids, a
sort of every cluster and a dozen int64 tensors per context token); the fast path's grows with what a row
reads.
"""

from __future__ import annotations

import torch

from sparse_methods.base import DecodeBatch
from sparse_methods.cluster_arena import ClusterArena
from sparse_methods.cluster_selection import ClusterRanking, cluster_columns


def rank_arena_clusters_reference(
    arena: ClusterArena,
    layer: int,
    batch: DecodeBatch,
    avg_cluster_size: int,
    head_dim: int,
    *,
    widths: tuple[int, int],
) -> ClusterRanking:
    """Every one of a row's ``Cw`` cluster columns ranked: softmax over the row's clusters of ``q . centroid
    * head_dim ** -0.5`` (empty ones masked), summed over the group's query heads, sorted descending by that
    sum truncated to 16 mantissa bits (``cluster_select.rank_values``; stable: ties to the lower cluster); then
    in the selection's layout for the plan's counts (``selection_layout``)."""
    from sparse_kernels.cluster_select import rank_values, selection_counts, selection_layout

    centroids, sizes_all = arena.centroid_values(layer), arena.layers[layer][1]
    n, heads = batch.query.shape[0], centroids.shape[0]
    clusters_w = cluster_columns(batch, avg_cluster_size)
    clu_base, count = arena.plan[1:3, :n]
    c = torch.arange(clusters_w, device=batch.query.device)
    cid = (clu_base[:, None] + c).clamp_(max=centroids.shape[1] - 1)  # [n, Cw]
    valid = c[None] < count[:, None]
    sizes = sizes_all[:, cid].permute(1, 0, 2).masked_fill(~valid[:, None], 0)  # [n, H, Cw]
    cent = centroids[:, cid].permute(1, 0, 2, 3).float()  # [n, H, Cw, D]
    q = batch.query.float().view(n, heads, -1, head_dim)
    logits = torch.einsum("nhgd,nhcd->nhgc", q, cent) * head_dim**-0.5
    empty = sizes == 0
    probs = torch.softmax(logits.masked_fill(empty[:, :, None], float("-inf")), dim=-1).sum(2)
    ranks = rank_values(probs.nan_to_num(nan=0.0), empty, q.shape[2])  # truncated to 16 mantissa bits
    order = torch.sort(ranks, dim=-1, descending=True, stable=True).indices  # [n, H, Cw]
    k1, k2 = selection_counts(arena.plan[5, :n], arena.plan[6, :n], clusters_w, *widths)
    return ClusterRanking(selection_layout(order, k1, k2), sizes, clusters_w)


def cluster_slots_reference(
    arena: ClusterArena, layer: int, batch: DecodeBatch, ranking: ClusterRanking, *, sink: int, width: int
) -> torch.Tensor:
    """``cluster_slots`` through a mask over every context token: the cluster token of each position ``j <
    tokens_w`` in rank order (searchsorted over the running sizes), scattered into ``[n, H, tokens_w + 1]``,
    with the sink and the tail, and compacted by a prefix sum."""
    offsets_all, positions = arena.layers[layer][2:4]
    n, heads = batch.query.shape[0], positions.shape[0]
    device = batch.query.device
    tokens_w = batch.max_pages * batch.block_size
    tok_base, clu_base, _, end, budget, _, _ = arena.plan[:, :n]
    kv = batch.kv_lens
    order, ranked, cum = ranking.order, ranking.ranked, ranking.cum
    cid = (clu_base[:, None] + torch.arange(ranking.columns, device=device)).clamp_(max=offsets_all.shape[1] - 1)
    j = torch.arange(tokens_w, device=device).expand(n, heads, tokens_w).contiguous()
    rank = torch.searchsorted(cum, j, right=True).clamp_(max=order.shape[-1] - 1)
    within = j - (cum - ranked).gather(-1, rank)
    cluster = order.gather(-1, rank)
    offsets = offsets_all[:, cid].permute(1, 0, 2).gather(-1, cluster)
    slot = (tok_base[:, None, None] + offsets + within).clamp_(0, positions.shape[1] - 1)
    head = torch.arange(heads, device=device)[None, :, None]
    picked = positions[head, slot].long()
    take = (j < budget[:, None, None]) & (j < cum[..., -1:])
    mask = torch.zeros(n, heads, tokens_w + 1, dtype=torch.bool, device=device)
    mask.scatter_(-1, torch.where(take, picked, tokens_w), True)
    t = torch.arange(tokens_w, device=device)
    exact = ((t[None] < sink) | (t[None] >= end[:, None])) & (t[None] < kv[:, None])  # [n, Tw]
    mask = mask[..., :tokens_w] | exact[:, None]
    slot_of = torch.where(mask, mask.cumsum(-1) - 1, width).clamp_(max=width)
    out = (kv - 1).clamp(min=0)[:, None, None].expand(n, heads, width + 1).contiguous()
    out.scatter_(-1, slot_of, t.expand(n, heads, tokens_w) * mask + (kv - 1)[:, None, None] * ~mask)
    return out[..., :width]


def estimated_cluster_ids_reference(arena: ClusterArena, batch: DecodeBatch, ranking: ClusterRanking, width: int):
    """``estimated_cluster_ids`` (``width`` ids) from a ranking of every column."""
    n, clusters_w = batch.query.shape[0], ranking.order.shape[-1]
    _, clu_base, count, _, budget, retrieved, estimated = arena.plan[:, :n]
    ranked, cum = ranking.ranked, ranking.cum
    read = ((cum - ranked) < budget[:, None, None]).sum(-1)  # [n, H] places read (empty ones too)
    k = torch.arange(width, device=ranked.device)
    rank = read[..., None] + k  # [n, H, E]
    wanted = torch.minimum(retrieved + estimated, count)[:, None] - read  # [n, H]
    ids = clu_base[:, None, None] + ranking.order.gather(-1, rank.clamp(max=clusters_w - 1))
    return torch.where((k < wanted[..., None]) & (rank < clusters_w), ids, -1)
