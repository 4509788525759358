"""RetroInfer (microsoft/RetrievalAttention): a per-KV-head cluster index over the keys, and decode
queries that read the sink, the recent tokens and the clusters whose centroids best match them.

Every token's KV stays resident (token-exact). Per request and layer, once the tokens before the
current step, less the ``retroinfer_recent_tokens`` newest, span ``retroinfer_min_index_tokens``
past the ``retroinfer_sink_tokens`` sink, the method clusters them (``sparse_kernels.cluster_index``:
segmented spherical k-means over the centred keys, about ``retroinfer_avg_cluster_size`` tokens per
cluster); each further ``retroinfer_update_tokens`` tokens (the recent ones still held back) get
their own clusters, appended. A decode query then reads, per KV head, the sink, every unindexed
token (the recent ones, the newest included) and the tokens of the ``R = clamp(round(C *
retroinfer_retrieval_ratio), 1, C)`` clusters that rank best (softmax over clusters of ``q . centroid``
summed over the group's query heads), up to a token budget (below); before an index exists it reads
everything. The retrieved clusters the budget does not reach and the ``min(round(C *
retroinfer_estimation_ratio), C - R)`` ranked next (the published system's counts) are estimated in the
same softmax: each as ``size`` tokens sharing the key ``centroid`` and the values' sum ``value_sum``
(``sparse_kernels.cluster_estimation``); the rest are omitted. ``sparse_kernels.cluster_attention`` is the
plain reference of the whole decode.

On the engine, one selection path (``select_decode``, slot entries, no host sync, CUDA-graph safe): the index is
built or extended outside graphs, from the stored keys ``on_attention_end`` hands over after the forward of the
steps that bring a request's processed tokens to a new index block (``prepare_step`` observes exactly those; the
method reads no queries, ``observes_queries`` False, so such a decode step still replays its graph; an appended block's
k-means replays a CUDA graph of its shape, ``sparse_kernels.cluster_index_graphs``), and written in place
into the request's row of the engine's fixed device buffers (``StoreKind.CLUSTER_INDEX``: a ``ClusterArena``
sized at build from ``memory_plan``'s ``index_clusters``, so graphs never see it move), which the decode rows
read through a per-step plan. The index keeps each cluster's value sum (summed in float32 from the values of its
tokens, stored in the model's dtype: ``cluster_arena.value_sum_dtype``), so the method observes the layers'
values with their keys (``observes_values``) while its estimation ratio is positive. A decode row then reads a
fixed number of slots, ``selection_size(kv_len)`` = ``min(kv_len, W)``, ``W`` = ``sink + recent + update + k *
avg`` rounded up to a multiple of ``WIDTH_QUANTUM`` slots (a stable width keeps the step's CUDA graph), with ``k
= clamp(round(C' * ratio), 1, C')`` and ``C' = (kv_len - 1 - recent - sink) // avg`` (the clusters a fresh index
would have): the sink, every unindexed token (at most ``recent + update``) and, filling the rest, the tokens of
the retrieved clusters in rank order (the last one truncated; ties in rank to the lower cluster). So a row reads
the published ``R`` clusters when they hold at most ``R * avg`` tokens (more right after an index update), and
with ``ratio = 1`` everything (dense). The estimation rides on the same ranking: ``select_decode`` answers a
``DecodeSelection`` whose ``extra`` is the estimated clusters' attention state (fixed width ``round(Cw *
retrieval_ratio) + round(Cw * estimation_ratio)`` for the batch's widest cluster count ``Cw``, unused entries
``-1``; the estimation's split states left unmerged, ``AttentionState.partial``), which the engine merges into
the decode kernel's softmax (in its reduce launch); the truncated cluster's unread tokens are
omitted (its value sum covers the tokens read too, so it cannot stand for the rest). With prefix caching a hit
simply indexes the cached keys. Ranking uses the usual ``head_dim ** -0.5`` scale, the estimation the
attention's own. A request whose context arrives without a step observing it (a prefix hit of all but its last
token, a benchmark's synthetic prefill) past the index threshold has no index at its first selecting query: that
one query reads the sink and its newest tokens (``selection_size`` of them), and estimates nothing; the step
builds the index."""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import Field, model_validator

from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import (
    Category,
    DecodeBatch,
    DecodeRead,
    DecodeSelection,
    LayerPlan,
    MemoryPlan,
    MethodConfig,
    ModelShape,
    PrefixCacheMode,
    SparseMethod,
    StepContext,
    Storage,
    StoreKind,
    Support,
    Unit,
)
from sparse_methods.cluster_arena import ClusterArena
from sparse_methods.cluster_selection import (
    cluster_columns,
    estimate_clusters,
    ordered_clusters,
    pick_clusters,
    rank_arena_clusters,
    selection_widths,
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
    retroinfer_centroid_dtype: Literal["model", "int8"] = Field(
        "int8",
        description="Centroids' storage: int8 codes with a float32 scale per (cluster, KV head), rounded to nearest "
        "(half the bytes each step's ranking reads; the index's centroid is then the decoded one), or the model "
        "dtype. On the H200 at batch 5 / 128K the codes' ranking took 0.79 ms a step against 0.99 and answered "
        "the same 324 of 360 quality samples as the model dtype (results/bench/h200/session33/).",
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


_SELECTED = LayerPlan(DecodeRead.SELECTED, unit=Unit.SLOT)
STACKED_TOKENS = 1 << 20
"""Token-heads (tokens x KV heads) indexed in one ``build_cluster_index``: blocks of one length from several
requests stack their heads up to this (an update block of 1024 tokens x 8 heads: 128 blocks), so a step that
completes blocks for a whole batch runs the k-means once per layer, not once per request and layer; a first
index of 128K tokens goes alone (its float32 copies stay ~0.5 GB each)."""


def _head_range(index, lo: int, hi: int):
    """KV heads ``[lo, hi)`` of a ``ClusterIndex`` (views)."""
    sums = None if index.value_sums is None else index.value_sums[lo:hi]
    return replace(
        index,
        centroids=index.centroids[lo:hi],
        value_sums=sums,
        sizes=index.sizes[lo:hi],
        offsets=index.offsets[lo:hi],
        sorted_positions=index.sorted_positions[lo:hi],
    )


@dataclass(frozen=True, slots=True)
class IndexExtent:
    """What the method keeps of a request's index in one layer: the tokens ``[start, end)`` it covers and its
    clusters (the arena holds the index itself)."""

    start: int
    end: int
    num_clusters: int


WIDTH_QUANTUM = 256
"""A decode row's width (slots) rounds up to a multiple of this. The width is part of a CUDA graph's key,
and ``sink + recent + update + R * avg`` grows by ``avg`` slots each time ``R`` does (every ~890 tokens at
the default ratio: a re-capture every ~890 decode steps, 2.4 s each on the H200 at 128K x 5); rounded,
it changes every ~14K tokens. The extra slots read the next-ranked clusters exactly."""


@register
class RetroInfer(SparseMethod):
    name = "retroinfer"
    category = Category.QUERY_AWARE_SELECTION
    prefix_cache_mode = PrefixCacheMode.RADIX
    Config = RetroInferConfig
    storage = Storage(StoreKind.CLUSTER_INDEX)  # per instance: its centroids' dtype
    supports = frozenset({Support.TENSOR_PARALLEL})  # an index and a cluster ranking per KV head
    observes_queries = False  # the index reads stored keys and values: an update step replays its graph

    def __init__(self, config: MethodConfig, shape: ModelShape):
        super().__init__(config, shape)
        self.storage = Storage(StoreKind.CLUSTER_INDEX, summary_dtype=self.config.retroinfer_centroid_dtype)
        self._index: dict[tuple[Hashable, int], IndexExtent] = {}  # (request id, layer) -> its index's extent
        self._observing: dict[Hashable, int] = {}  # this step: request -> tokens processed after it
        self._blocks = None  # the appended blocks' graphed index builder, made on first use
        self._pending: list[tuple[int, list, torch.Tensor, torch.Tensor | None]] = []  # gathered, not yet indexed
        self._pending_shape = (0, 1)  # the pending blocks' (length, segments)
        full = [layer for layer in range(shape.num_layers) if layer not in shape.windowed_layers]
        self._last_layer = full[-1] if full else -1  # where a step's pending blocks are indexed together
        self._width = 0  # this step's widest selection (slots)
        self.observes_values = self.config.retroinfer_estimation_ratio > 0  # value sums for the estimation

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        """Every token stays; the index holds at most one cluster per ``avg`` indexed tokens (a first index
        and each appended block make ``tokens // avg`` clusters at most)."""
        c, total = self.config, prompt_len + max_new_tokens
        indexed = max(0, total - c.retroinfer_recent_tokens - c.retroinfer_sink_tokens)
        clusters = indexed // c.retroinfer_avg_cluster_size
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len, prompt_len, total, index_clusters=clusters)

    @property
    def arena(self) -> ClusterArena:
        if self.cluster_arena is None:
            raise RuntimeError("retroinfer reads its indexes from the engine's cluster arena (StoreKind.CLUSTER_INDEX)")
        return self.cluster_arena

    def layer_plan(self, layer: int) -> LayerPlan:
        return _SELECTED

    def selection_size(self, kv_len: int, page_size: int) -> int | None:
        """Slots a decode query of a ``kv_len`` context reads (module docstring); None (everything) before
        an index exists."""
        from sparse_kernels.cluster_attention import cluster_counts

        c = self.config
        indexed = kv_len - 1 - c.retroinfer_recent_tokens - c.retroinfer_sink_tokens
        if indexed < c.retroinfer_min_index_tokens:
            return None
        count = indexed // c.retroinfer_avg_cluster_size
        retrieved, _ = cluster_counts(count, c.retroinfer_retrieval_ratio, 0.0)
        exact = c.retroinfer_sink_tokens + c.retroinfer_recent_tokens + c.retroinfer_update_tokens
        return min(kv_len, -(-(exact + retrieved * c.retroinfer_avg_cluster_size) // WIDTH_QUANTUM) * WIDTH_QUANTUM)

    def decode_read_tokens(self, layer: int, kv_len: int, block_size: int) -> int:
        """The tokens a decode query reads exactly, plus its index reads in token equivalents (one token: K and
        V of one KV head in the 2-byte KV dtype RetroInfer runs on): every cluster's centroid (model dtype, or
        int8 codes and a float32 scale), size and offset (int32), and the estimated clusters' value sums (model
        dtype). Estimated: the best
        ``ordered_clusters + E`` less those the budget reads, at a budget whose unindexed tail is the average
        between index updates (``recent + update / 2``) and clusters of the average size."""
        from sparse_kernels.cluster_attention import cluster_counts

        tokens = super().decode_read_tokens(layer, kv_len, block_size)
        c, dim, avg = self.config, self.shape.head_dim, self.config.retroinfer_avg_cluster_size
        indexed = kv_len - 1 - c.retroinfer_recent_tokens - c.retroinfer_sink_tokens
        if indexed < c.retroinfer_min_index_tokens:
            return tokens
        count = indexed // avg
        retrieved, estimated = cluster_counts(count, c.retroinfer_retrieval_ratio, c.retroinfer_estimation_ratio)
        tail = c.retroinfer_recent_tokens + c.retroinfer_update_tokens // 2
        budget = max(0, self.selection_size(kv_len, block_size) - c.retroinfer_sink_tokens - tail)
        ranked = min(count, ordered_clusters(retrieved, budget, avg, count) + estimated)
        estimated = ranked - min(ranked, -(-budget // avg))
        centroid = dim + 4 if self.storage.summary_dtype == "int8" else 2 * dim
        index_bytes = count * (centroid + 8) + estimated * 2 * dim
        return tokens + -(-index_bytes // (4 * dim))

    def prepare_step(self, step: StepContext) -> Collection[Hashable]:
        """Observe the requests whose index this step starts or extends; plan the decode rows' arena reads
        (the leading single-token rows that select, in order)."""
        self._observing = {}
        for r in step.requests:
            if r.replay is None and self._due_blocks((r.request_id, 0), r.end):  # every layer's index alike
                self._observing[r.request_id] = r.end
        from sparse_kernels.cluster_attention import cluster_counts

        c = self.config
        rows, width, ratio = [], 0, c.retroinfer_estimation_ratio
        for r in step.requests:
            if r.num_new_tokens != 1:
                break
            kv_len = r.kv_lens[0] + 1
            size = self.selection_size(kv_len, 1)
            if size is None:
                continue
            index, sink = self._index.get((r.request_id, 0)), c.retroinfer_sink_tokens
            if index is None:  # its context arrived unobserved (a prefix hit, a synthetic prefill): no index
                rows.append((0, 0, 0, kv_len - (size - sink), 0, 0, 0))  # until this step's end: sink + newest tokens
            else:
                tokens, clusters = self.arena.bases(r.request_id)
                budget = size - sink - (kv_len - index.end)
                retrieved, estimated = cluster_counts(index.num_clusters, c.retroinfer_retrieval_ratio, ratio)
                retrieved = ordered_clusters(retrieved, budget, c.retroinfer_avg_cluster_size, index.num_clusters)
                rows.append((tokens, clusters, index.num_clusters, index.end, budget, retrieved, estimated))
            width = max(width, size)
        self._width = width
        if rows:
            self.arena.plan_rows(rows)
        return frozenset(self._observing)

    def on_attention_end(self, layer: int, batch: LayerAttentionBatch) -> None:
        """Index the blocks this step completes for the observed requests (``_due_blocks``), all of one length
        and kind together, and write them into the requests' arena rows (this step's selection in ``layer``
        read the rows already; the step's plan reads no new cluster)."""
        due = []
        for i, request in enumerate(batch.requests):
            processed = self._observing.get(request.request_id)
            if processed is not None:
                due += [(i, *span) for span in self._due_blocks((request.request_id, layer), processed)]
        groups: dict[tuple[int, int | None], list[tuple[int, int, int, int | None]]] = {}
        for block in due:
            groups.setdefault((block[2] - block[1], block[3]), []).append(block)
        for (length, segments), blocks in groups.items():
            per = max(1, STACKED_TOKENS // (length * self.shape.num_kv_heads))
            for lo in range(0, len(blocks), per):
                self._index_blocks(layer, batch, blocks[lo : lo + per], length, segments)

    def _due_blocks(self, key: tuple[Hashable, int], processed: int) -> list[tuple[int, int, int | None]]:
        """The blocks ``(lo, hi, segments)`` that index the first ``processed`` tokens less the recent ones, as the
        published system does after each step: a first index over ``[sink, end)`` once it spans the threshold
        (``segments`` None: ``build_cluster_index``'s default), then ``retroinfer_update_tokens`` each."""
        c = self.config
        end, extent = processed - c.retroinfer_recent_tokens, self._index.get(key)
        blocks, at = [], extent.end if extent is not None else None
        if at is None:
            if end - c.retroinfer_sink_tokens < c.retroinfer_min_index_tokens:
                return []
            blocks.append((c.retroinfer_sink_tokens, end, None))
            at = end
        while end - at >= c.retroinfer_update_tokens:
            blocks.append((at, at + c.retroinfer_update_tokens, 1))
            at += c.retroinfer_update_tokens
        return blocks

    def _index_blocks(self, layer: int, batch: LayerAttentionBatch, blocks, length: int, segments) -> None:
        """Gather ``blocks`` ``(request, lo, hi, segments)`` of one ``length`` with their KV heads stacked. A first
        index is built (one ``build_cluster_index``) and appended to the arena at once; appended blocks wait in
        ``_pending`` so that several layers' share one graphed k-means (``_flush``)."""
        from sparse_kernels.cluster_index import build_cluster_index

        if batch.batched:
            keys, values = batch.keys.spans([b[0] for b in blocks], [b[1] for b in blocks], length)
        else:
            views = [(batch.request(i), lo, hi) for i, lo, hi, _ in blocks]
            keys = torch.stack([v.keys[lo:hi] for v, lo, hi in views])
            has = all(v.values is not None for v, _, _ in views)
            values = torch.stack([v.values[lo:hi] for v, lo, hi in views]) if has else None
        if self.observes_values and values is None:
            raise ValueError("retroinfer estimates clusters from value sums: the engine must hand over the values")
        n, h = len(blocks), self.shape.num_kv_heads
        stacked = keys.permute(1, 0, 2, 3).reshape(length, n * h, -1)
        vals = values.permute(1, 0, 2, 3).reshape(length, n * h, -1) if self.observes_values else None
        spans = [(batch.requests[i].request_id, lo, hi) for i, lo, hi, _ in blocks]
        if segments is None:  # a first index: its length is the prompt's, a shape seen once
            avg = self.config.retroinfer_avg_cluster_size
            self._append(layer, spans, build_cluster_index(stacked, vals, start=0, avg_cluster_size=avg, segments=None))
            return
        if self._blocks is None:  # appended blocks repeat their shape every update: replayed from a CUDA graph
            from sparse_kernels.cluster_index_graphs import GraphedIndexBuilder

            self._blocks = GraphedIndexBuilder()
        token_heads = length * (sum(p[2].shape[1] for p in self._pending) + n * h)
        if self._pending and (self._pending_shape != (length, segments) or token_heads > self._blocks.max_token_heads):
            self._flush()
        self._pending.append((layer, spans, stacked, vals))
        self._pending_shape = (length, segments)
        if layer == self._last_layer:
            self._flush()

    def _flush(self) -> None:
        """Index the pending appended blocks (several layers' heads stacked, all of one shape) in one k-means
        replay and append each layer's part to its requests' arena rows, in the order they were observed."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []

        def heads(i: int) -> torch.Tensor | None:  # the blocks' i-th tensors with their heads stacked
            parts = [p[i] for p in pending]
            return None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

        avg = self.config.retroinfer_avg_cluster_size
        whole = self._blocks(heads(2), heads(3), avg_cluster_size=avg, segments=self._pending_shape[1])
        at = 0
        for layer, spans, stacked, _ in pending:
            heads = stacked.shape[1]
            self._append(layer, spans, _head_range(whole, at, at + heads))
            at += heads

    def _append(self, layer: int, spans, whole) -> None:
        """Append the blocks ``spans`` ``(request_id, lo, hi)`` of ``whole`` (their heads stacked in that order)
        to their requests' indexes in ``layer``: the extents here, the clusters in the arena."""
        writes = []
        for request_id, lo, hi in spans:
            key = (request_id, layer)
            extent = self._index.get(key)
            at_cluster, at_token = (0, 0) if extent is None else (extent.num_clusters, extent.end - extent.start)
            writes.append((request_id, at_cluster, at_token, lo))
            start = lo if extent is None else extent.start
            self._index[key] = IndexExtent(start, hi, at_cluster + whole.num_clusters)
        self.arena.write_blocks(layer, whole, writes)

    def finish_step(self) -> dict:
        self._flush()  # normally done at the last full-attention layer already
        return {}

    def release(self, request_id: Hashable) -> None:
        self._flush()
        dropped = [k for k in self._index if k[0] == request_id]
        for key in dropped:
            del self._index[key]
        if self.cluster_arena is not None:
            self.cluster_arena.release(request_id)

    def index(self, request_id: Hashable, layer: int):
        """The request's ``ClusterIndex`` in ``layer``, views into its arena row (None before it has one)."""
        extent = self._index.get((request_id, layer))
        if extent is None:
            return None
        return self.arena.read(request_id, layer, extent.start, extent.end, extent.num_clusters, self.observes_values)

    def select_decode(self, layer: int, batch: DecodeBatch) -> torch.Tensor | DecodeSelection:
        """Per row and KV head, slots: the sink, the retrieved clusters' tokens in rank order up to the row's
        budget and the unindexed tail (``cluster_selection``); ``[B, H, width]``, a narrower row's entries past
        its own width repeat its newest slot. With a positive estimation ratio, a ``DecodeSelection`` whose
        ``extra`` estimates the retrieved clusters the budget cut off and the estimated ones. Device only, fixed
        shapes (from ``batch.max_pages``)."""
        c, sink, avg = self.config, self.config.retroinfer_sink_tokens, self.config.retroinfer_avg_cluster_size
        ratio = c.retroinfer_estimation_ratio if self.observes_values else 0.0
        budget = max(0, self._width - sink)
        widths = selection_widths(cluster_columns(batch, avg), c.retroinfer_retrieval_ratio, ratio, budget, avg)
        ranking = rank_arena_clusters(self.arena, layer, batch, avg, self.shape.head_dim, widths=widths)
        slots, ids = pick_clusters(self.arena, layer, batch, ranking, sink=sink, width=self._width, widths=widths)
        if ids is None:
            return slots
        return DecodeSelection(slots, estimate_clusters(self.arena, layer, batch, ids, ranking, partial=True))
