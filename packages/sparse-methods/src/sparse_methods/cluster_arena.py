"""RetroInfer's cluster indexes of every indexed request, packed per layer into device tensors that a
CUDA graph can read (``select_decode``), with a per-step plan saying which packed index each decode row reads.

Per layer: ``centroids`` ``[H, clusters, D]``, ``sizes`` int64 ``[H, clusters]``, ``offsets`` int64
``[H, clusters]`` (a cluster's first entry in its request's ``positions``), ``positions`` int64
``[H, tokens]`` (token positions grouped by cluster). A request's index occupies the columns
``[cluster_base, cluster_base + num_clusters)`` and ``[token_base, token_base + tokens)``; the bases are
the same in every layer (every layer indexes the same token ranges). ``pack`` rewrites the arena from the
live indexes (outside graphs: at prompt end and every update block); it reallocates only when they
outgrow it, which bumps ``version`` (graphs captured over the old tensors must not replay).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from sparse_methods.request_rows import fill

MIN_ROWS = 1024
"""Plan columns at least (a CUDA graph's padded batch reads one per row)."""
PLAN_FIELDS = 5
"""Per decode row: token base, cluster base, clusters, index end, cluster-token budget."""


class ClusterArena:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.version = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.bases: dict[Hashable, tuple[int, int]] = {}  # request -> (token base, cluster base)
        self.plan: torch.Tensor | None = None  # int64 [PLAN_FIELDS, rows]

    def pack(self, indexes: Mapping[tuple[Hashable, int], object]) -> None:
        """Pack every request's ``ClusterIndex`` per layer (``indexes``: (request, layer) -> index; a request
        has one in every layer or none)."""
        requests = sorted({rid for rid, _ in indexes}, key=repr)
        self.bases, tokens, clusters = {}, 0, 0
        for rid in requests:
            first = indexes[(rid, 0)]
            self.bases[rid] = (tokens, clusters)
            tokens += first.sorted_positions.shape[1]
            clusters += first.num_clusters
        if not requests:
            return
        sample = indexes[(requests[0], 0)]
        heads, _, dim = sample.centroids.shape
        if not self.layers or self.layers[0][3].shape[1] < tokens or self.layers[0][0].shape[1] < clusters:
            cap_t = max(tokens, 2 * (self.layers[0][3].shape[1] if self.layers else 0))
            cap_c = max(clusters, 2 * (self.layers[0][0].shape[1] if self.layers else 0))
            device, dtype = sample.centroids.device, sample.centroids.dtype
            self.layers = [
                (
                    torch.zeros(heads, cap_c, dim, dtype=dtype, device=device),
                    torch.zeros(heads, cap_c, dtype=torch.int64, device=device),
                    torch.zeros(heads, cap_c, dtype=torch.int64, device=device),
                    torch.zeros(heads, cap_t, dtype=torch.int64, device=device),
                )
                for _ in range(self.num_layers)
            ]
            self.version += 1
        for layer, (centroids, sizes, offsets, positions) in enumerate(self.layers):
            for rid in requests:
                index, (t0, c0) = indexes[(rid, layer)], self.bases[rid]
                c1, t1 = c0 + index.num_clusters, t0 + index.sorted_positions.shape[1]
                centroids[:, c0:c1] = index.centroids
                sizes[:, c0:c1] = index.sizes
                offsets[:, c0:c1] = index.offsets
                positions[:, t0:t1] = index.sorted_positions

    def plan_rows(self, rows: Sequence[tuple[int, int, int, int, int]], device: torch.device | str) -> None:
        """The next step's decode rows in batch order (PLAN_FIELDS each); rows past them (a graph's padding)
        read no cluster and everything from position 0 (never more than their width). One copy."""
        capacity = 0 if self.plan is None else self.plan.shape[1]
        if self.plan is None or capacity < len(rows):
            self.plan = torch.zeros(
                PLAN_FIELDS, max(len(rows), 2 * capacity, MIN_ROWS), dtype=torch.int64, device=device
            )
            self.version += 1
        host = torch.zeros(self.plan.shape, dtype=torch.int64)
        if rows:
            host[:, : len(rows)] = torch.tensor(rows, dtype=torch.int64).T
        fill(self.plan, host)
