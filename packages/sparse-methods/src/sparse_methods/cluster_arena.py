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
With ``centroid_codes`` the centroids are int8 codes with a float32 scale per (KV head, cluster) in
``centroid_scales[layer]`` ``[H, rows * clusters]`` (``sparse_kernels.cluster_logits.encode_centroids``, written
with each block): the index's centroid is then the decoded ``scale * code``, half the bytes a step's ranking reads.
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
        *,
        centroid_codes: bool = False,
    ):
        """``plan_rows``: decode rows one step plans at most (a CUDA graph's padded batch included);
        ``centroid_codes``: centroids as int8 codes with a scale each (module docstring)."""
        if min(num_rows, tokens, clusters, plan_rows) < 1:
            sizes = (num_rows, tokens, clusters, plan_rows)
            raise ValueError(f"a cluster arena needs rows, tokens, clusters and plan rows, got {sizes}")
        self.tokens, self.clusters = tokens, clusters
        h, c, t = num_kv_heads, num_rows * clusters, num_rows * tokens

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.layers = [
            (
                zeros(h, c, head_dim, dtype=torch.int8 if centroid_codes else dtype),
                zeros(h, c),
                zeros(h, c),
                zeros(h, t),
                zeros(h, c, head_dim, dtype=value_sum_dtype(dtype)),
            )
            for _ in range(num_layers)
        ]
        self.centroid_scales = [zeros(h, c, dtype=torch.float32) for _ in range(num_layers)] if centroid_codes else None
        self.rows = RequestRows(num_rows, "cluster index")
        self.plan = zeros(PLAN_FIELDS, plan_rows, dtype=torch.int64)

    @staticmethod
    def num_bytes(
        num_layers, num_rows, tokens, clusters, num_kv_heads, head_dim, dtype: torch.dtype, *, centroid_codes=False
    ) -> int:
        """Device bytes of an arena of these sizes."""
        # per cluster: centroid (codes and a float32 scale, or the model dtype), value sum, size and offset
        centroid = head_dim + 4 if centroid_codes else head_dim * dtype.itemsize
        per_cluster = centroid + head_dim * value_sum_dtype(dtype).itemsize + 2 * 4
        return num_layers * num_kv_heads * num_rows * (clusters * per_cluster + tokens * 4)

    @property
    def nbytes(self) -> int:
        """Device bytes the arena holds (its per-layer buffers)."""
        scales = sum(t.numel() * t.element_size() for t in self.centroid_scales or ())
        return scales + sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    def centroids(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``layer``'s centroids ``[H, C, D]`` as stored, and their scales ``[H, C]`` when they are codes (else
        None)."""
        return self.layers[layer][0], None if self.centroid_scales is None else self.centroid_scales[layer]

    def centroid_values(self, layer: int) -> torch.Tensor:
        """``layer``'s centroids ``[H, C, D]`` as the index holds them: decoded to float32 when stored as codes."""
        from sparse_kernels.cluster_logits import decode_centroids

        stored, scale = self.centroids(layer)
        return stored if scale is None else decode_centroids(stored, scale)

    def bases(self, request_id: Hashable) -> tuple[int, int]:
        """The request's first token and first cluster column (it holds a row)."""
        row = self.rows[request_id]
        return row * self.tokens, row * self.clusters

    def write(self, request_id: Hashable, layer: int, block, *, at_cluster: int = 0, at_token: int = 0) -> None:
        """Write ``block`` (a ``sparse_kernels.cluster_index.ClusterIndex``: a first index, or a block of tokens
        indexed on its own) into the request's row of ``layer``, its clusters from column ``at_cluster`` and its
        tokens from entry ``at_token`` of the row (an index grows by appending blocks: the clusters and tokens
        already there stay). The request takes a row on its first write."""
        self.write_blocks(layer, block, [(request_id, at_cluster, at_token, 0)])

    def write_blocks(self, layer: int, stacked, blocks: Sequence[tuple[Hashable, int, int, int]]) -> None:
        """Write the blocks of ``stacked`` (a ``ClusterIndex`` whose heads are ``len(blocks)`` blocks' KV heads
        stacked, block ``j`` at heads ``[j * H, (j + 1) * H)``, all of one length) into their requests' rows of
        ``layer``: ``blocks[j] = (request_id, at_cluster, at_token, shift)``, as ``write`` places one, its
        token positions plus ``shift``. One indexed copy per buffer for all of them (an index update of a
        whole batch costs a few launches a layer, not a few per request)."""
        n = len(blocks)
        heads, count = self.layers[layer][0].shape[0], stacked.num_clusters
        length = stacked.sorted_positions.shape[1]
        if stacked.centroids.shape[0] != n * heads:
            raise ValueError(f"{n} blocks of {heads} KV heads need {n * heads} heads, got {stacked.centroids.shape[0]}")
        for _, at_cluster, at_token, _ in blocks:  # all checked before any row is taken or written
            if at_cluster + count > self.clusters or at_token + length > self.tokens:
                raise ValueError(
                    f"a cluster index of {at_cluster + count} clusters over {at_token + length} tokens outgrows its "
                    f"arena row ({self.clusters} clusters, {self.tokens} tokens): the memory plan's bound is wrong"
                )
        cols, toks = [], []
        for request_id, at_cluster, at_token, _ in blocks:
            self.rows.take(request_id)
            t0, c0 = self.bases(request_id)
            cols.append(c0 + at_cluster)
            toks.append(t0 + at_token)
        centroids, sizes, offsets, positions, value_sums = self.layers[layer]
        device = centroids.device
        host = torch.tensor([cols, toks, [b[2] for b in blocks], [b[3] for b in blocks]], dtype=torch.int64)
        firsts = host.to(device)  # one copy: column and entry bases, offsets' and positions' shifts
        col = (firsts[0, :, None] + torch.arange(count, device=device)).view(-1)
        tok = (firsts[1, :, None] + torch.arange(length, device=device)).view(-1)

        def per_head(x: torch.Tensor) -> torch.Tensor:  # [n * H, k, ...] -> [H, n * k, ...], block-major
            return x.reshape(n, heads, *x.shape[1:]).transpose(0, 1).reshape(heads, n * x.shape[1], *x.shape[2:])

        if self.centroid_scales is None:
            centroids.index_copy_(1, col, per_head(stacked.centroids.to(centroids.dtype)))
        else:
            from sparse_kernels.cluster_logits import encode_centroids

            codes, scale = encode_centroids(stacked.centroids)
            centroids.index_copy_(1, col, per_head(codes))
            self.centroid_scales[layer].index_copy_(1, col, per_head(scale))
        if stacked.value_sums is not None:
            value_sums.index_copy_(1, col, per_head(stacked.value_sums.to(value_sums.dtype)))
        sizes.index_copy_(1, col, per_head(stacked.sizes.to(sizes.dtype)))
        shifted = stacked.offsets.reshape(n, heads, count) + firsts[2, :, None, None]
        offsets.index_copy_(1, col, per_head(shifted.reshape(n * heads, count).to(offsets.dtype)))
        moved = stacked.sorted_positions.reshape(n, heads, length) + firsts[3, :, None, None]
        positions.index_copy_(1, tok, per_head(moved.reshape(n * heads, length).to(positions.dtype)))

    def read(self, request_id: Hashable, layer: int, start: int, end: int, clusters: int, values: bool = True):
        """The request's index of ``layer`` as a ``ClusterIndex`` of views into its row: ``clusters`` clusters over
        the tokens ``[start, end)``; ``values`` False: without value sums (an index of keys alone). Coded
        centroids come decoded (float32, a copy)."""
        from sparse_kernels.cluster_index import ClusterIndex
        from sparse_kernels.cluster_logits import decode_centroids

        t0, c0 = self.bases(request_id)
        _, sizes, offsets, positions, value_sums = self.layers[layer]
        c = slice(c0, c0 + clusters)
        stored, scale = self.centroids(layer)
        return ClusterIndex(
            start=start,
            end=end,
            centroids=stored[:, c] if scale is None else decode_centroids(stored[:, c], scale[:, c]),
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
