"""Cluster indexes (RetroInfer's) of every running request in fixed device buffers, per layer, that a CUDA
graph can read, with a per-step plan saying which request's index each decode row reads.

The engine builds one for a method whose store is ``StoreKind.CLUSTER_INDEX`` before the KV pool takes the
free memory (``SparseMethod.cluster_arena``), sized once: ``num_rows`` requests (the most that run at
once), each holding at most ``tokens`` indexed tokens in ``clusters`` clusters per layer (its memory plan's
``index_clusters``). Nothing moves afterwards, so a captured graph's pointers stay valid; a request takes
a row on its first index and gives it back on release, and growing an index writes its new clusters in
place in its row (``write``). The arena is where the indexes live: a method keeps only each index's extent
(its tokens and clusters) and reads an index back as views (``read``).

Per layer: ``centroids`` ``[H, rows * clusters, D]``, ``sizes`` and ``offsets`` int32 ``[H, rows *
clusters]`` (a cluster's first entry in its request's ``positions``), ``positions`` int32 ``[H, rows *
tokens]`` (token positions grouped by cluster) and ``value_sums`` ``[H, rows * clusters, D]`` (the sum of
each cluster's values, ``value_sum_dtype``; left as they were for an index built from keys alone).
Row ``r``'s index
occupies the columns from ``r * clusters`` and ``r * tokens``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from sparse_methods.request_rows import RequestRows, fill

PLAN_FIELDS = 7
"""Per decode row: token base, cluster base, clusters, index end, cluster-token budget, clusters retrieved,
clusters estimated."""


def value_sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arena's value sums: in the model's dtype (a bf16 model reads half the bytes of float32 sums in the
    estimation; summed in float32 before they are stored), but bf16 for float16 (a sum of many values may pass
    float16's range)."""
    return torch.bfloat16 if dtype == torch.float16 else dtype


class ClusterArena:
    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        tokens: int,
        clusters: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        plan_rows: int,
    ):
        """``plan_rows``: decode rows one step plans at most (a CUDA graph's padded batch included)."""
        if min(num_rows, tokens, clusters, plan_rows) < 1:
            sizes = (num_rows, tokens, clusters, plan_rows)
            raise ValueError(f"a cluster arena needs rows, tokens, clusters and plan rows, got {sizes}")
        self.tokens, self.clusters = tokens, clusters
        h, c, t = num_kv_heads, num_rows * clusters, num_rows * tokens

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.layers = [
            (
                zeros(h, c, head_dim, dtype=dtype),
                zeros(h, c),
                zeros(h, c),
                zeros(h, t),
                zeros(h, c, head_dim, dtype=value_sum_dtype(dtype)),
            )
            for _ in range(num_layers)
        ]
        self.rows = RequestRows(num_rows, "cluster index")
        self.plan = zeros(PLAN_FIELDS, plan_rows, dtype=torch.int64)

    @staticmethod
    def num_bytes(num_layers, num_rows, tokens, clusters, num_kv_heads, head_dim, dtype: torch.dtype) -> int:
        """Device bytes of an arena of these sizes."""
        # per cluster: centroid, value sum, size and offset
        per_cluster = head_dim * (dtype.itemsize + value_sum_dtype(dtype).itemsize) + 2 * 4
        return num_layers * num_kv_heads * num_rows * (clusters * per_cluster + tokens * 4)

    def bases(self, request_id: Hashable) -> tuple[int, int]:
        """The request's first token and first cluster column (it holds a row)."""
        row = self.rows[request_id]
        return row * self.tokens, row * self.clusters

    def write(self, request_id: Hashable, layer: int, block, *, at_cluster: int = 0, at_token: int = 0) -> None:
        """Write ``block`` (a ``sparse_kernels.cluster_index.ClusterIndex``: a first index, or a block of tokens
        indexed on its own) into the request's row of ``layer``, its clusters from column ``at_cluster`` and its
        tokens from entry ``at_token`` of the row (an index grows by appending blocks: the clusters and tokens
        already there stay). The request takes a row on its first write."""
        clusters = at_cluster + block.num_clusters
        tokens = at_token + block.sorted_positions.shape[1]
        if clusters > self.clusters or tokens > self.tokens:
            raise ValueError(
                f"a cluster index of {clusters} clusters over {tokens} tokens outgrows its arena row "
                f"({self.clusters} clusters, {self.tokens} tokens): the memory plan's bound is wrong"
            )
        self.rows.take(request_id)
        t0, c0 = self.bases(request_id)
        c_at, c_end, t_at, t_end = c0 + at_cluster, c0 + clusters, t0 + at_token, t0 + tokens
        centroids, sizes, offsets, positions, value_sums = self.layers[layer]
        centroids[:, c_at:c_end] = block.centroids
        if block.value_sums is not None:
            value_sums[:, c_at:c_end] = block.value_sums
        sizes[:, c_at:c_end] = block.sizes
        offsets[:, c_at:c_end] = block.offsets + at_token
        positions[:, t_at:t_end] = block.sorted_positions

    def read(self, request_id: Hashable, layer: int, start: int, end: int, clusters: int, values: bool = True):
        """The request's index of ``layer`` as a ``ClusterIndex`` of views into its row: ``clusters`` clusters over
        the tokens ``[start, end)``; ``values`` False: without value sums (an index of keys alone)."""
        from sparse_kernels.cluster_index import ClusterIndex

        t0, c0 = self.bases(request_id)
        centroids, sizes, offsets, positions, value_sums = self.layers[layer]
        c = slice(c0, c0 + clusters)
        return ClusterIndex(
            start=start,
            end=end,
            centroids=centroids[:, c],
            value_sums=value_sums[:, c] if values else None,
            sizes=sizes[:, c],
            offsets=offsets[:, c].long(),
            sorted_positions=positions[:, t0 : t0 + end - start],
        )

    def release(self, request_id: Hashable) -> None:
        self.rows.release(request_id)

    def plan_rows(self, rows: Sequence[tuple[int, ...]]) -> None:
        """The next step's decode rows in batch order (``PLAN_FIELDS`` each); rows past them (a graph's
        padding) read no cluster and everything from position 0 (never more than their width). One copy."""
        if len(rows) > self.plan.shape[1]:
            raise ValueError(f"{len(rows)} decode rows exceed the cluster arena's plan of {self.plan.shape[1]}")
        host = torch.zeros(self.plan.shape, dtype=torch.int64)
        if rows:
            host[:, : len(rows)] = torch.tensor(rows, dtype=torch.int64).T
        fill(self.plan, host)
