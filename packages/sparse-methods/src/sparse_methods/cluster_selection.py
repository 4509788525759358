"""RetroInfer's decode over a ``ClusterArena``, batched on the device: rank each decode row's clusters, pick
the slots the row reads exactly, and estimate the clusters ranked next (``RetroInfer.select_decode``).

The arena's per-step plan (``ClusterArena.plan``) says per row where its index lives, how many clusters it
has, where it ends, how many cluster tokens the row reads (its budget), how many clusters it retrieves and
how many it estimates (the published system's counts, ``cluster_counts``). Every shape comes from
``DecodeBatch.max_pages`` (``Cw = max_pages * block_size // avg`` cluster columns), the step's selection width
and the ratios, so the ops run under CUDA graphs with no host sync; columns past a row's index, and empty
clusters, rank last with size 0.

The work grows with what a row reads, not with its context: the ranking reads the centroids in their stored
dtype straight from the arena (``sparse_kernels.cluster_logits``: on CUDA a Triton kernel accumulating in
float32, no gathered copy) and selects by count (``sparse_kernels.cluster_select``: the retrieved clusters in
rank order, the estimated ones as a set; on CUDA a radix select, no sort of the row); the picks
(``sparse_kernels.cluster_picks``: on CUDA two Triton kernels, or one) take the retrieved clusters' tokens in rank
order up to each row's budget, with the sink and the unindexed tail, and estimate the retrieved clusters the
budget cut off with the estimated ones; the estimation is ``sparse_kernels.cluster_estimation``, which takes
the estimated clusters' scores from the ranking's logits (kept in ``ClusterRanking``) instead of reading their
centroids again.
``cluster_selection_reference`` is the full-sort, per-context-token version the tests hold this equal to;
``sparse_kernels.cluster_attention`` the plain per-request reference of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_methods.base import AttentionState, DecodeBatch
from sparse_methods.cluster_arena import ClusterArena


@dataclass(frozen=True, slots=True)
class ClusterRanking:
    """One layer's ranking of a decode batch's clusters, per row and KV head: ``order`` int64 ``[n, H, k]``
    cluster columns (from the row's cluster base), a row's retrieved ones best first, then its estimated ones
    (any order; the reference ranks every column); ``sizes`` int32 ``[n, H, Cw]`` every column's size (0:
    empty or past the row's index); ``columns`` the ``Cw`` columns ranked; ``logits`` float32 ``[n, H, G, Cw]``
    the ranking's ``q . centroid * scale`` per query head (``-inf``: empty or past the row's index), which the
    estimation reuses (None: the estimation reads the centroids). ``ranked`` (the ordered columns' sizes) and
    ``cum`` (their running sums) are computed on demand: the device picks make their own."""

    order: torch.Tensor
    sizes: torch.Tensor
    columns: int
    logits: torch.Tensor | None = None
    scale: float = 1.0

    @property
    def ranked(self) -> torch.Tensor:
        return self.sizes.gather(-1, self.order)

    @property
    def cum(self) -> torch.Tensor:
        return self.ranked.cumsum(-1)


def cluster_columns(batch: DecodeBatch, avg_cluster_size: int) -> int:
    """``Cw``: cluster columns of a row (no row's index has more clusters than its tokens allow)."""
    return max(1, batch.max_pages * batch.block_size // avg_cluster_size)


ORDERED_PER_BUDGET = 2
"""A row ranks in order at least this many clusters per average cluster's worth of its token budget."""


def ordered_clusters(retrieved: int, budget: int, avg_cluster_size: int, clusters: int) -> int:
    """Clusters a row takes in rank order: the published ``retrieved``, or more when its token budget holds
    more (a row's fixed width also holds the unindexed tokens' share, which right after an index update it
    reads from clusters): enough to fill the budget twice over at the average cluster size, so that it is
    read best first unless the best clusters run small."""
    return min(clusters, max(retrieved, -(-ORDERED_PER_BUDGET * budget // avg_cluster_size)))


def selection_widths(
    columns: int, retrieval_ratio: float, estimation_ratio: float, budget: int, avg_cluster_size: int
) -> tuple[int, int]:
    """Ordered and estimated clusters per row and KV head, fixed for ``Cw`` columns and the step's largest
    token ``budget``: no row's counts (``ordered_clusters`` and ``cluster_counts`` of its clusters, at most
    ``Cw``) exceed them; 0 estimated at ratio 0."""
    retrieved = ordered_clusters(max(1, round(columns * retrieval_ratio)), budget, avg_cluster_size, columns)
    return retrieved, min(columns, round(columns * estimation_ratio)) if estimation_ratio > 0 else 0


def rank_arena_clusters(
    arena: ClusterArena,
    layer: int,
    batch: DecodeBatch,
    avg_cluster_size: int,
    head_dim: int,
    *,
    widths: tuple[int, int],
) -> ClusterRanking:
    """Per row and KV head: softmax over the row's clusters of ``q . centroid * head_dim ** -0.5`` (empty ones
    masked), summed over the group's query heads; the row's retrieved clusters best first (ties to the lower
    cluster), then its estimated ones (``sparse_kernels.cluster_select``, ``widths`` from ``selection_widths``)."""
    from sparse_kernels.cluster_logits import cluster_logits
    from sparse_kernels.cluster_select import cluster_select

    (centroids, centroid_scale), sizes_all = arena.centroids(layer), arena.layers[layer][1]
    n, columns = batch.query.shape[0], cluster_columns(batch, avg_cluster_size)
    clu_base, count = arena.plan[1:3, :n]
    ranked = cluster_logits(
        batch.query, centroids, sizes_all, clu_base, count, columns, scale=head_dim**-0.5, centroid_scale=centroid_scale
    )
    order = cluster_select(
        ranked.logits, ranked.sizes, arena.plan[5, :n], arena.plan[6, :n], read_width=widths[0],
        estimate_width=widths[1], tile_max=ranked.tile_max, tile_sum=ranked.tile_sum,
    )  # fmt: skip
    return ClusterRanking(order, ranked.sizes, columns, ranked.logits, head_dim**-0.5)


def pick_clusters(
    arena: ClusterArena,
    layer: int,
    batch: DecodeBatch,
    ranking: ClusterRanking,
    *,
    sink: int,
    width: int,
    widths: tuple[int, int],
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(slots, ids)`` per row and KV head (``sparse_kernels.cluster_picks``).

    ``slots`` ``[n, H, width]``: the ``sink`` first slots, then the first ``budget`` tokens of the clusters in
    the ranking's order (each cluster's in index order, the last one cut short), then the unindexed tail (the newest
    last); entries past a row's own count repeat its newest slot. As the plan makes them (a row's budget is
    at most ``width - sink``, its index holds distinct positions in ``[sink, end)``) the three parts are
    disjoint; sorted, a row is the reference's ascending one (``cluster_slots_reference``). Not sorted here:
    the decode's sum does not depend on the order, and the segmented sort of the picked tokens took ~20 us per
    layer at batch 5 / 128K on the H200 (``radixSortKVInPlace``, 0.73 ms per step in
    ``results/bench/h200/session11/retro_2f862a4``).

    ``ids`` int64 ``[n, H, retrieved + estimated]`` (the ``widths``; None when no cluster is estimated): arena
    columns of the estimated clusters, those ordered after the ``read`` ones whose tokens the slots hold (wholly
    or in part) up to the row's retrieved plus estimated; ``-1`` past them."""
    from sparse_kernels.cluster_picks import cluster_picks

    offsets_all, positions = arena.layers[layer][2:4]
    n = batch.query.shape[0]
    reach = min(batch.max_pages * batch.block_size, max(1, width - sink))  # cluster tokens a row may read
    return cluster_picks(
        ranking.order,
        ranking.sizes,
        offsets_all,
        positions,
        arena.plan[:, :n],
        batch.kv_lens,
        sink=sink,
        width=width,
        reach=reach,
        estimate_width=sum(widths) if widths[1] > 0 else 0,
        backend=backend,
    )


def estimate_clusters(
    arena: ClusterArena,
    layer: int,
    batch: DecodeBatch,
    ids: torch.Tensor,
    ranking: ClusterRanking | None = None,
    *,
    partial: bool = False,
) -> AttentionState:
    """The estimated clusters' attention state (``sparse_kernels.cluster_estimation`` at the attention's
    scale) over ``ids`` (``pick_clusters``): with a ``ranking`` that kept its logits, the scores are those
    logits times ``batch.sm_scale / ranking.scale`` (the ranking's scale is ``head_dim ** -0.5``, the
    attention's may differ), read at the rows' columns ``id - arena.plan[1]``; else from the centroids.
    ``partial``: as the estimation's splits left it (``AttentionState.partial``), for the decode to merge."""
    from sparse_kernels.cluster_estimation import cluster_estimation

    _, sizes_all, _, _, value_sums = arena.layers[layer]
    if ranking is None or ranking.logits is None:  # coded centroids decoded (a float32 copy of the layer's)
        args = (batch.query, arena.centroid_values(layer), value_sums, sizes_all, ids)
        return AttentionState(*cluster_estimation(*args, scale=batch.sm_scale, partial=partial))
    args = (batch.query, arena.centroids(layer)[0], value_sums, sizes_all, ids)  # centroids for their shape only
    n = batch.query.shape[0]
    logits = dict(logits=ranking.logits, bases=arena.plan[1, :n], logits_scale=ranking.scale)
    return AttentionState(*cluster_estimation(*args, scale=batch.sm_scale, partial=partial, **logits))
