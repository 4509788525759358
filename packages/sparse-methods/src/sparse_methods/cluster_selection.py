"""RetroInfer's decode over a ``ClusterArena``, batched on the device: rank each decode row's clusters, pick
the slots the row reads exactly, and estimate the clusters ranked next (``RetroInfer.select_decode``).

The arena's per-step plan (``ClusterArena.plan``) says per row where its index lives, how many clusters it
has, where it ends, how many cluster tokens the row reads (its budget) and how many clusters it estimates.
Every shape comes from ``DecodeBatch.max_pages`` (``Cw = max_pages * block_size // avg`` cluster columns),
so the ops run under CUDA graphs with no host sync; columns past a row's index, and empty clusters, rank
last with size 0. ``sparse_kernels.cluster_attention`` is the plain per-request reference of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_methods.base import AttentionState, DecodeBatch
from sparse_methods.cluster_arena import ClusterArena


@dataclass(frozen=True, slots=True)
class ClusterRanking:
    """One layer's ranking of a decode batch's clusters: ``cid`` int64 ``[n, Cw]`` the arena columns of each
    row's clusters; ``order`` int64 ``[n, H, Cw]`` cluster indices best first per KV head; ``ranked`` int32
    ``[n, H, Cw]`` their sizes in that order (0: empty or past the row's index) and ``cum`` their running sums."""

    cid: torch.Tensor
    order: torch.Tensor
    ranked: torch.Tensor
    cum: torch.Tensor


def rank_arena_clusters(
    arena: ClusterArena, layer: int, batch: DecodeBatch, avg_cluster_size: int, head_dim: int
) -> ClusterRanking:
    """Per row and KV head: softmax over the row's clusters of ``q . centroid * head_dim ** -0.5`` (empty ones
    masked), summed over the group's query heads, sorted descending (stable: ties to the lower cluster)."""
    centroids, sizes_all = arena.layers[layer][:2]
    n, heads = batch.query.shape[0], centroids.shape[0]
    clusters_w = max(1, batch.max_pages * batch.block_size // avg_cluster_size)
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
    scores = probs.nan_to_num(nan=0.0).masked_fill(empty, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [n, H, Cw]
    ranked = sizes.gather(-1, order)
    return ClusterRanking(cid, order, ranked, ranked.cumsum(-1))


def cluster_slots(
    arena: ClusterArena, layer: int, batch: DecodeBatch, ranking: ClusterRanking, *, sink: int, width: int
) -> torch.Tensor:
    """``[n, H, width]`` ascending slots per row and KV head: the ``sink`` first slots, the unindexed tail and
    the first ``budget`` tokens of the clusters in rank order (each cluster's in index order, the last one
    cut short); entries past a row's own count repeat its newest slot."""
    offsets_all, positions = arena.layers[layer][2:4]
    n, heads = batch.query.shape[0], positions.shape[0]
    device = batch.query.device
    tokens_w = batch.max_pages * batch.block_size
    tok_base, _, _, end, budget, _ = arena.plan[:, :n]
    kv = batch.kv_lens
    order, ranked, cum = ranking.order, ranking.ranked, ranking.cum
    j = torch.arange(tokens_w, device=device).expand(n, heads, tokens_w).contiguous()
    rank = torch.searchsorted(cum, j, right=True).clamp_(max=order.shape[-1] - 1)
    within = j - (cum - ranked).gather(-1, rank)
    cluster = order.gather(-1, rank)
    offsets = offsets_all[:, ranking.cid].permute(1, 0, 2).gather(-1, cluster)
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


def estimate_clusters(
    arena: ClusterArena, layer: int, batch: DecodeBatch, ranking: ClusterRanking, ratio: float
) -> AttentionState:
    """The estimated clusters' attention state (``sparse_kernels.cluster_estimation`` at the attention's
    scale): per row and KV head, the ``min(estimated, C - read)`` clusters ranked after the ``read`` ones
    whose tokens ``cluster_slots`` reads (wholly or in part), over a fixed width ``round(Cw * ratio)``."""
    from sparse_kernels.cluster_estimation import cluster_estimation

    centroids, sizes_all, _, _, value_sums = arena.layers[layer]
    n, clusters_w = batch.query.shape[0], ranking.order.shape[-1]
    _, clu_base, count, _, budget, estimated = arena.plan[:, :n]
    ranked, cum = ranking.ranked, ranking.cum
    read = (((cum - ranked) < budget[:, None, None]) & (ranked > 0)).sum(-1)  # [n, H]
    width = max(1, min(clusters_w, round(clusters_w * ratio)))  # no row estimates more (its C <= Cw)
    k = torch.arange(width, device=ranked.device)
    rank = read[..., None] + k  # [n, H, E]
    wanted = torch.minimum(estimated[:, None], count[:, None] - read)  # [n, H]
    ids = clu_base[:, None, None] + ranking.order.gather(-1, rank.clamp(max=clusters_w - 1))
    ids = torch.where((k < wanted[..., None]) & (rank < clusters_w), ids, -1)
    out, lse = cluster_estimation(batch.query, centroids, value_sums, sizes_all, ids, scale=batch.sm_scale)
    return AttentionState(out, lse)
