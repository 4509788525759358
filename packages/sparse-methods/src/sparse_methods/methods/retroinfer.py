"""RetroInfer (microsoft/RetrievalAttention): a per-KV-head cluster index over the keys, and decode
queries that read the sink, the recent tokens and the clusters whose centroids best match them.

Every token's KV stays resident (token-exact). Per request and layer, once the tokens before the
current step, less the ``retroinfer_recent_tokens`` newest, span ``retroinfer_min_index_tokens``
past the ``retroinfer_sink_tokens`` sink, the method clusters them (``sparse_kernels.cluster_index``:
segmented spherical k-means over the centred keys, about ``retroinfer_avg_cluster_size`` tokens per
cluster); each further ``retroinfer_update_tokens`` tokens (the recent ones still held back) get
their own clusters, appended. A decode query then reads, per KV head, the sink, every unindexed
token (the recent ones, the newest included) and every token of the ``round(C *
retroinfer_retrieval_ratio)`` clusters that rank best (softmax over clusters of ``q . centroid``
summed over the group's query heads); before an index exists it reads everything.

Not here yet (issue 17): the published decode also estimates the next ``retroinfer_estimation_ratio``
clusters from centroid x size and value sums in the same softmax (``sparse_kernels.cluster_attention``
has the reference); the engine's decode path reads a selection and has no hook for that term, so a
positive estimation ratio (the default) is refused once a request's context is long enough to index.
The index lives in this object per request and layer, built from the keys the engine hands each
decode query (``LayerPlan.decode_keys``), not yet as a store kind in ``sparse-cache``; with prefix
caching a hit simply indexes the cached keys. Ranking uses the usual ``head_dim ** -0.5`` scale.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from pydantic import Field, model_validator

from sparse_methods.base import (
    Category,
    DecodeRead,
    DecodeView,
    LayerPlan,
    MemoryPlan,
    MethodConfig,
    ModelShape,
    PrefixCacheMode,
    RequestStep,
    Selection,
    SparseMethod,
    Support,
    Unit,
)
from sparse_methods.registry import register


class RetroInferConfig(MethodConfig):
    retroinfer_sink_tokens: int = Field(4, ge=0, description="Leading tokens always read exactly.")
    retroinfer_recent_tokens: int = Field(64, ge=1, description="Newest tokens kept out of the index, read exactly.")
    retroinfer_min_index_tokens: int = Field(
        16384, ge=1, description="Tokens (past the sink, before the recent ones) that start the index."
    )
    retroinfer_update_tokens: int = Field(1024, ge=1, description="Tokens per appended block of clusters.")
    retroinfer_avg_cluster_size: int = Field(16, ge=1, description="Average tokens per cluster.")
    retroinfer_retrieval_ratio: float = Field(
        0.018, gt=0, le=1, description="Fraction of clusters whose tokens are read exactly."
    )
    retroinfer_estimation_ratio: float = Field(
        0.232, ge=0, le=1, description="Fraction of clusters estimated from centroid, size and value sums."
    )

    @model_validator(mode="after")
    def _check(self) -> RetroInferConfig:
        if self.retroinfer_retrieval_ratio + self.retroinfer_estimation_ratio > 1:
            raise ValueError("retroinfer_retrieval_ratio + retroinfer_estimation_ratio must be at most 1")
        avg = self.retroinfer_avg_cluster_size
        for name in ("retroinfer_update_tokens", "retroinfer_min_index_tokens"):
            if getattr(self, name) % avg:
                raise ValueError(f"{name} must be a multiple of retroinfer_avg_cluster_size ({avg})")
        return self


_PER_REQUEST = LayerPlan(DecodeRead.PER_REQUEST, decode_keys=True, unit=Unit.SLOT)


@register
class RetroInfer(SparseMethod):
    name = "retroinfer"
    category = Category.QUERY_AWARE_SELECTION
    prefix_cache_mode = PrefixCacheMode.RADIX
    Config = RetroInferConfig
    supports = frozenset({Support.TENSOR_PARALLEL})  # an index and a cluster ranking per KV head

    def __init__(self, config: MethodConfig, shape: ModelShape):
        super().__init__(config, shape)
        self._index: dict = {}  # (request id, layer) -> sparse_kernels.cluster_index.ClusterIndex

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len, prompt_len, prompt_len + max_new_tokens)

    def layer_plan(self, layer: int) -> LayerPlan:
        return _PER_REQUEST

    def selection_size(self, kv_len: int, page_size: int) -> int | None:
        """An estimate of the slots read, for reports (what is read depends on the clusters' sizes): the
        sink, the recent tokens, the retrieved clusters at their average size and one slot-equivalent per
        cluster for its centroid (ranking reads them all); None (everything) before an index exists."""
        from sparse_kernels.cluster_attention import cluster_counts

        c = self.config
        indexed = kv_len - 1 - c.retroinfer_recent_tokens - c.retroinfer_sink_tokens
        if indexed < c.retroinfer_min_index_tokens:
            return None
        count = indexed // c.retroinfer_avg_cluster_size
        retrieved, _ = cluster_counts(count, c.retroinfer_retrieval_ratio, 0.0)
        unindexed = c.retroinfer_sink_tokens + c.retroinfer_recent_tokens + 1
        return unindexed + retrieved * c.retroinfer_avg_cluster_size + count

    def release(self, request_id: Hashable) -> None:
        for key in [k for k in self._index if k[0] == request_id]:
            del self._index[key]

    def index(self, request_id: Hashable, layer: int):
        """The request's ``ClusterIndex`` in ``layer`` (None before it has one)."""
        return self._index.get((request_id, layer))

    def _update(self, key: tuple[Hashable, int], keys: torch.Tensor, processed: int):
        """Index tokens of ``processed`` (those before this step), as the published system does after each step."""
        from sparse_kernels.cluster_index import build_cluster_index, concat_indexes

        c = self.config
        avg, end = c.retroinfer_avg_cluster_size, processed - c.retroinfer_recent_tokens
        index = self._index.get(key)
        if index is None:
            if end - c.retroinfer_sink_tokens < c.retroinfer_min_index_tokens:
                return None
            sink = c.retroinfer_sink_tokens
            index = build_cluster_index(keys[sink:end], None, start=sink, avg_cluster_size=avg)
        while end - index.end >= c.retroinfer_update_tokens:
            lo, hi = index.end, index.end + c.retroinfer_update_tokens
            index = concat_indexes(
                index, build_cluster_index(keys[lo:hi], None, start=lo, avg_cluster_size=avg, segments=1)
            )
        self._index[key] = index
        return index

    def decode_selection(self, layer: int, request: RequestStep, view: DecodeView) -> Selection | None:
        from sparse_kernels.cluster_attention import cluster_counts, exact_positions, rank_clusters

        index = self._update((request.request_id, layer), view.keys, view.kv_len - 1)
        if index is None:
            return None
        if self.config.retroinfer_estimation_ratio > 0:
            raise NotImplementedError(
                "retroinfer: estimated clusters are not in the engine's decode path yet (it reads a selection and "
                "has no estimation term); pass retroinfer_estimation_ratio=0 to read the retrieved clusters only"
            )
        retrieved, _ = cluster_counts(index.num_clusters, self.config.retroinfer_retrieval_ratio, 0.0)
        ranked = rank_clusters(view.query, index, self.shape.head_dim**-0.5, retrieved)
        sink = self.config.retroinfer_sink_tokens
        rows = [exact_positions(index, ranked[h], h, sink=sink, kv_len=view.kv_len) for h in range(ranked.shape[0])]
        width = max(r.numel() for r in rows)
        indices = torch.full((len(rows), width), -1, dtype=torch.int64, device=view.query.device)
        for h, r in enumerate(rows):
            indices[h, width - r.numel() :] = r
        return Selection(indices, 1)
