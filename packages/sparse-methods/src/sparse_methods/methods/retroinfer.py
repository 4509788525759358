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

On the engine, one selection path (``select_decode``, slot entries, no host sync, CUDA-graph safe): the
index is built or extended outside graphs, from the keys ``on_attention_end`` hands over at the steps
that bring a request's processed tokens to a new index block (``prepare_step`` observes exactly those),
and written in place into the request's row of the engine's fixed device buffers (``StoreKind.CLUSTER_INDEX``:
a ``ClusterArena`` sized at build from ``memory_plan``'s ``index_clusters``, so graphs never see it move),
which the decode rows read through a per-step plan. A decode row then reads a fixed number of slots,
``selection_size(kv_len)`` = ``min(kv_len, sink + recent + update + k * avg)`` with
``k = clamp(round(C' * ratio), 1, C')`` and ``C' = (kv_len - 1 - recent - sink) // avg`` (the clusters a
fresh index would have): the sink, every unindexed token (at most ``recent + update``) and, filling the
rest, the tokens of the clusters in rank order (the last one truncated; ties in rank to the lower
cluster). So a row reads at least the published ``round(C * ratio)`` clusters' worth of tokens, more right
after an index update, and with ``ratio = 1`` everything (dense). With prefix caching a hit simply indexes
the cached keys. Ranking uses the usual ``head_dim ** -0.5`` scale. A request whose context arrives
without a step observing it (a prefix hit of all but its last token, a benchmark's synthetic prefill) past
the index threshold has no index at its first selecting query: that one query reads the sink and its
newest tokens (``selection_size`` of them), and the step builds the index.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

import torch
from pydantic import Field, model_validator

from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import (
    Category,
    DecodeBatch,
    DecodeRead,
    LayerAttention,
    LayerPlan,
    MemoryPlan,
    MethodConfig,
    ModelShape,
    PrefixCacheMode,
    RequestStep,
    SparseMethod,
    StepContext,
    Storage,
    StoreKind,
    Support,
    Unit,
)
from sparse_methods.cluster_arena import ClusterArena
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


_SELECTED = LayerPlan(DecodeRead.SELECTED, unit=Unit.SLOT)


@register
class RetroInfer(SparseMethod):
    name = "retroinfer"
    category = Category.QUERY_AWARE_SELECTION
    prefix_cache_mode = PrefixCacheMode.RADIX
    Config = RetroInferConfig
    storage = Storage(StoreKind.CLUSTER_INDEX)
    supports = frozenset({Support.TENSOR_PARALLEL})  # an index and a cluster ranking per KV head

    def __init__(self, config: MethodConfig, shape: ModelShape):
        super().__init__(config, shape)
        self._index: dict = {}  # (request id, layer) -> sparse_kernels.cluster_index.ClusterIndex
        self._observing: dict[Hashable, int] = {}  # this step: request -> tokens processed after it
        self._width = 0  # this step's widest selection (slots)

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
        return min(kv_len, exact + retrieved * c.retroinfer_avg_cluster_size)

    def _due(self, request_id: Hashable, processed: int) -> bool:
        """Whether ``processed`` tokens start an index or a new update block for the request."""
        c = self.config
        end = processed - c.retroinfer_recent_tokens
        index = self._index.get((request_id, 0))
        if index is None:
            return end - c.retroinfer_sink_tokens >= c.retroinfer_min_index_tokens
        return end - index.end >= c.retroinfer_update_tokens

    def prepare_step(self, step: StepContext) -> Collection[Hashable]:
        """Observe the requests whose index this step starts or extends; plan the decode rows' arena reads
        (the leading single-token rows that select, in order)."""
        self._observing = {}
        for r in step.requests:
            if r.replay is None and self._due(r.request_id, r.end):
                self._observing[r.request_id] = r.end
        rows, width = [], 0
        for r in step.requests:
            if r.num_new_tokens != 1:
                break
            kv_len = r.kv_lens[0] + 1
            size = self.selection_size(kv_len, 1)
            if size is None:
                continue
            index, sink = self._index.get((r.request_id, 0)), self.config.retroinfer_sink_tokens
            if index is None:  # its context arrived unobserved (a prefix hit, a synthetic prefill): no index
                rows.append((0, 0, 0, kv_len - (size - sink), 0))  # until this step's end: sink + newest tokens
            else:
                tokens, clusters = self.arena.bases(r.request_id)
                rows.append((tokens, clusters, index.num_clusters, index.end, size - sink - (kv_len - index.end)))
            width = max(width, size)
        self._width = width
        if rows:
            self.arena.plan_rows(rows)
        return frozenset(self._observing)

    def on_attention_end(self, layer: int, batch: LayerAttentionBatch) -> None:
        for request, view in batch:
            self._observe(layer, request, view)

    def _observe(self, layer: int, request: RequestStep, view: LayerAttention) -> None:
        """Build or extend the request's index of ``layer`` and write what changed into its arena row (this
        step's selection in ``layer`` read the row already; the step's plan reads no new cluster)."""
        processed = self._observing.get(request.request_id)
        if processed is None:
            return
        key = (request.request_id, layer)
        previous = self._index.get(key)
        index = self._update(key, view.keys, processed)
        if index is not None and index is not previous:
            self.arena.write(request.request_id, layer, index, previous)

    def release(self, request_id: Hashable) -> None:
        dropped = [k for k in self._index if k[0] == request_id]
        for key in dropped:
            del self._index[key]
        if self.cluster_arena is not None:
            self.cluster_arena.release(request_id)

    def index(self, request_id: Hashable, layer: int):
        """The request's ``ClusterIndex`` in ``layer`` (None before it has one)."""
        return self._index.get((request_id, layer))

    def _update(self, key: tuple[Hashable, int], keys: torch.Tensor, processed: int):
        """Index the first ``processed`` tokens less the recent ones, as the published system does after each step."""
        from sparse_kernels.cluster_index import build_cluster_index, concat_indexes

        c = self.config
        avg, end = c.retroinfer_avg_cluster_size, processed - c.retroinfer_recent_tokens
        index = self._index.get(key)
        if index is None:
            if end - c.retroinfer_sink_tokens < c.retroinfer_min_index_tokens:
                return None
            if c.retroinfer_estimation_ratio > 0:
                raise NotImplementedError(
                    "retroinfer: estimated clusters are not in the engine's decode path yet (it reads a selection "
                    "and has no estimation term); pass retroinfer_estimation_ratio=0 to read the retrieved clusters"
                )
            sink = c.retroinfer_sink_tokens
            index = build_cluster_index(keys[sink:end], None, start=sink, avg_cluster_size=avg)
        while end - index.end >= c.retroinfer_update_tokens:
            lo, hi = index.end, index.end + c.retroinfer_update_tokens
            index = concat_indexes(
                index, build_cluster_index(keys[lo:hi], None, start=lo, avg_cluster_size=avg, segments=1)
            )
        self._index[key] = index
        return index

    def select_decode(self, layer: int, batch: DecodeBatch) -> torch.Tensor:
        """Per row and KV head, ascending slots: the sink, the unindexed tail and the clusters' tokens in rank
        order up to the row's budget (softmax over the row's clusters of ``q . centroid * head_dim ** -0.5``
        summed over the group, stable descending sort); ``[B, H, width]``, a narrower row's entries past
        its own width repeat its newest slot. Device only, fixed shapes (from ``batch.max_pages``)."""
        centroids, sizes_all, offsets_all, positions = self.arena.layers[layer]
        n, heads, dim = batch.query.shape[0], self.shape.num_kv_heads, self.shape.head_dim
        device = batch.query.device
        tokens_w = batch.max_pages * batch.block_size
        clusters_w = max(1, tokens_w // self.config.retroinfer_avg_cluster_size)
        tok_base, clu_base, count, end, budget = self.arena.plan[:, :n]
        kv = batch.kv_lens
        c = torch.arange(clusters_w, device=device)
        cid = (clu_base[:, None] + c).clamp_(max=centroids.shape[1] - 1)  # [n, Cw]
        valid = c[None] < count[:, None]
        sizes = sizes_all[:, cid].permute(1, 0, 2).masked_fill(~valid[:, None], 0)  # [n, H, Cw]
        cent = centroids[:, cid].permute(1, 0, 2, 3).float()  # [n, H, Cw, D]
        q = batch.query.float().view(n, heads, -1, dim)
        logits = torch.einsum("nhgd,nhcd->nhgc", q, cent) * dim**-0.5
        empty = sizes == 0
        probs = torch.softmax(logits.masked_fill(empty[:, :, None], float("-inf")), dim=-1).sum(2)
        scores = probs.nan_to_num(nan=0.0).masked_fill(empty, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [n, H, Cw]
        ranked = sizes.gather(-1, order)
        cum = ranked.cumsum(-1)
        j = torch.arange(tokens_w, device=device).expand(n, heads, tokens_w).contiguous()
        rank = torch.searchsorted(cum, j, right=True).clamp_(max=clusters_w - 1)
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
        sink = self.config.retroinfer_sink_tokens
        exact = ((t[None] < sink) | (t[None] >= end[:, None])) & (t[None] < kv[:, None])  # [n, Tw]
        mask = mask[..., :tokens_w] | exact[:, None]
        width = self._width
        slot_of = torch.where(mask, mask.cumsum(-1) - 1, width).clamp_(max=width)
        out = (kv - 1).clamp(min=0)[:, None, None].expand(n, heads, width + 1).contiguous()
        out.scatter_(-1, slot_of, t.expand(n, heads, tokens_w) * mask + (kv - 1)[:, None, None] * ~mask)
        return out[..., :width]
