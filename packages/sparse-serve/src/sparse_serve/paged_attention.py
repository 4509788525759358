"""The engine's attention backend: store the step's K/V in the pool, attend over pages, and hand
the sparse method the inputs it asked for.

Plans both kernels once per step and layer group from the host metadata (the kernels a group's
layers use: windowed or not); each layer's
``forward`` is then device-only unless the method asked to observe this layer's attention inputs
(score-based eviction), which gathers the requested requests' keys. Single-token items go to the
decode kernel, prefill chunks to the prefill kernel. No method is named here: the method says how
each layer reads (``layer_plan``) and which requests the step observes (``prepare_step``'s answer,
handed to ``plan``).

A head-major store (one table per (layer, KV head) lane) runs the same kernels with a row per
(request, KV head): one KV head, the head's query group as the query heads (``_forward_lanes``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Hashable, Sequence

import torch

from sparse_cache import TailRows
from sparse_kernels import (
    BatchDecodeWithPagedKVCache,
    BatchPrefillWithPagedKVCache,
    Rotation,
    block_summary,
    rope_store,
    store_kv,
)
from sparse_kernels.block_summary import quantized_block_summary
from sparse_kernels.kv_quant import dequantize_blocks
from sparse_kernels.quantized_store import store_kv_quantized
from sparse_methods import (
    DENSE_LAYER,
    DecodeScoreSums,
    LayerAttention,
    LayerAttentionBatch,
    QueryRing,
    SparseMethod,
)
from sparse_serve.kv_pool import KVPool
from sparse_serve.latent_paged_attention import LatentPagedAttention
from sparse_serve.observed_keys import ObservedRows, observed_rows
from sparse_serve.selective_decode import SelectiveDecode
from sparse_serve.selective_prefill import SelectivePrefill
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata, table_slots, to_device, to_device_buffer

# A head-major store's prefill rows are (request, KV head) lanes: the cascade split would make a fused call per
# lane (``BatchPrefillWithPagedKVCache(cascade=...)``); off, they all go through the paged kernel's one launch.
# Benchmarks A/B it.
HEAD_MAJOR_CASCADE = False


class _GroupPlan:
    """Device-side slot mapping and kernel plans of one layer group.

    With capacities given, the slot mapping and the decode kernel's metadata live in fixed buffers
    that each plan fills in place, so a captured CUDA graph keeps reading the current step's values.
    """

    def __init__(
        self, device: torch.device, make_prefill, max_tokens: int | None = None, max_batch_size=None, max_num_pages=None
    ):
        self.device = device
        self.decode = BatchDecodeWithPagedKVCache(device, max_batch_size=max_batch_size, max_num_pages=max_num_pages)
        self.prefill = make_prefill(device)
        self._slots = torch.empty(max_tokens, dtype=torch.int32, device=device) if max_tokens else None
        self._tails = torch.empty(max_tokens, dtype=torch.int32, device=device) if max_tokens else None
        self.slot_mapping: torch.Tensor | None = None
        self._prefill_rows: torch.Tensor | None = None  # head-major groups: lane order of the prefill rows
        self.tail_index: torch.Tensor | None = None  # per token row: its request's tail row (tailed stores)
        self.window_left = -1  # the sliding window of the layers this plan serves (-1: none)

    def _load(self, host: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
        return to_device_buffer(host, buffer, self.device)

    def _window(self) -> dict:
        # Only windowed plans pass it: a method's own prefill wrapper (global layers) need not take it.
        return {} if self.window_left < 0 else {"window_left": self.window_left}

    def prefill_rows(self, group: LayerGroupMetadata) -> torch.Tensor:
        """A head-major group's ``prefill_rows`` on the device (copied once per step)."""
        if self._prefill_rows is None:
            self._prefill_rows = to_device(group.prefill_rows, self.device)
        return self._prefill_rows

    def plan(
        self,
        group: LayerGroupMetadata,
        meta: StepMetadata,
        shape: dict,
        sm_scale: float,
        tails: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``tails``: per token row and per request, each request's tail row (stores with a tail)."""
        self.slot_mapping = self._load(group.slot_mapping, self._slots)
        self._prefill_rows = None
        self.tail_index = None if tails is None else self._load(tails[0], self._tails)
        nd = meta.num_decode_tokens
        if nd:
            extra = {} if tails is None else {"tail_index": tails[1][:nd]}
            self.decode.plan(
                group.decode_kv_indptr,
                group.decode_kv_indices,
                group.decode_kv_last_len,
                sm_scale=sm_scale,
                **shape,
                **extra,
                **self._window(),
            )
        if meta.num_prefill_requests:
            extra = {} if tails is None else {"tail_index": tails[1][nd:]}
            self.prefill.plan(
                group.prefill_qo_indptr,
                group.prefill_kv_indptr,
                group.prefill_kv_indices,
                group.prefill_kv_last_len,
                causal=True,
                sm_scale=sm_scale,
                **shape,
                **extra,
                **self._window(),
            )


class PagedAttention:
    """Implements ``sparse_models.AttentionBackend`` over a ``KVPool``."""

    def __init__(
        self,
        pool: KVPool,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        method: SparseMethod | None = None,
        tail_rows: TailRows | None = None,
        static_scales: tuple[tuple[float, float], ...] | None = None,
        max_num_tokens: int | None = None,
        max_batch_size: int | None = None,
        max_num_pages: int | None = None,
        sm_scale: float | None = None,
        layer_windows: Sequence[int] = (),
        group_queries: Callable[[torch.Tensor], torch.Tensor] | None = None,
        num_graph_groups: int = 1,
        query_ring: QueryRing | None = None,
        score_sums: DecodeScoreSums | None = None,
    ):
        """``sm_scale``: the softmax scale the model passes (default ``head_dim ** -0.5``). ``layer_windows``:
        per layer its sliding window as the kernels' ``window_left`` (-1: full attention; empty: none).
        Windowed layers attend through plans of their own, dense: sparse methods act on full layers only.
        ``group_queries``: under tensor parallelism, ``q [T, local heads, D]`` -> the query heads of this
        rank's KV groups (gathered from the ranks that share a replicated KV head): what the method sees,
        so every rank holding a KV head selects and evicts the same tokens of it. ``num_graph_groups``: the
        leading layer groups whose plans keep fixed buffers (a decode step's groups under CUDA graphs: one,
        or one per layer in the per-layer layout). ``query_ring``: the method's ring of recent decode queries,
        which every full-attention layer writes its decode rows into (graph-safe: CUDA graphs capture it).
        ``score_sums``: the method's running decode scores, which every full-attention layer's decode kernel
        feeds through its score output (likewise captured)."""
        self.pool = pool
        self.device = pool.device
        self.quantized = pool.quantized  # per layer, or None for plain stores
        self.tail_rows = tail_rows
        self.static_scales = static_scales
        if pool.store.has_tail and tail_rows is None:
            raise ValueError(f"a {pool.store.describe()} store needs tail rows")
        self.block_size = block_size
        self.shape = dict(num_qo_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
        self.lanes = num_kv_heads if pool.store.head_major else 1  # rows per request of a head-major plan
        if self.lanes > 1:  # the kernels see one KV head and its query group per row
            self.shape = dict(self.shape, num_qo_heads=num_q_heads // num_kv_heads, num_kv_heads=1)
        self.method = method
        self.group_queries = group_queries
        self.query_ring = query_ring
        self.score_sums = score_sums
        self._score_columns = 0  # the planned decode step's score columns (its CSR tokens)
        # Prefill chunks attend through the method's prefill attention (e.g. block-sparse) where it has one.
        prefill_attention = None if method is None else method.prefill_attention
        self._make_prefill = (
            BatchPrefillWithPagedKVCache if prefill_attention is None else prefill_attention.prefill_wrapper
        )
        if prefill_attention is None and self.lanes > 1:  # many narrow rows: one paged launch, no fused calls
            self._make_prefill = functools.partial(BatchPrefillWithPagedKVCache, cascade=HEAD_MAJOR_CASCADE)
        # The leading groups' plans have fixed-capacity buffers (CUDA graphs replay against them).
        self._caps = (max_num_tokens, max_batch_size, max_num_pages)
        self._num_graph_groups = num_graph_groups
        self._meta: StepMetadata | None = None
        self._layer_window = {layer: w for layer, w in enumerate(layer_windows) if w >= 0}
        # Plans by group index (a group's layers all slide or none does, with a table per layer).
        self._window_plans: dict[int, dict[int, _GroupPlan]] = {w: {} for w in set(self._layer_window.values())}
        self._plans: dict[int, _GroupPlan] = {0: self._new_plan(None, 0)}
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.latent = None  # MLA: queries and cached rows in latent space (``LatentPagedAttention``)
        if pool.store.latent:
            self.latent = LatentPagedAttention(
                pool.latent,
                num_heads=num_q_heads,
                latent_dim=pool.store.latent_dim,
                block_size=block_size,
                summary=pool.summary if pool.store.summaries else None,
                method=method,
                group_queries=group_queries,
                capacities=(max_num_tokens, max_batch_size, max_num_pages),
                sm_scale=self.sm_scale,
            )
        # Per layer group (its own tables): the first keeps fixed buffers for graphs, the rest grow as needed.
        # The first is the batched selection path CUDA graphs ask for their keys (a latent store's: its own).
        self._plain = self.latent is None and self.quantized is None and self.lanes == 1  # model-dtype K/V, one lane
        self._selectives = [
            self.latent.selective
            if self.latent is not None
            else SelectiveDecode(
                self.device, self.shape, self.sm_scale, max_batch_size=max_batch_size, max_num_pages=max_num_pages
            )
        ]
        self.selective_prefill = SelectivePrefill(self.device, self.shape, self.sm_scale)
        self._touched: list[tuple[torch.Tensor, torch.Tensor]] | None = []  # None: summaries from slot mappings
        self._slot_blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # quantized: a decode step's blocks
        self._observed_slots: dict[tuple, torch.Tensor] = {}  # (table, step row, kv_len) -> slots, this step
        self._observed: Collection[Hashable] = frozenset()  # requests the method observes this step
        self._observed_index: list[int] = []  # their items in the step
        self._observed_tables: dict[int, ObservedRows | None] = {}  # id(group) -> their rows, this step

    def plan(self, meta: StepMetadata, observed: Collection[Hashable] = frozenset()) -> None:
        """Prepare one step: copy each layer group's slot mapping and plan its kernels. ``observed``: the
        requests whose attention inputs every full-attention layer hands the method (``prepare_step``)."""
        self._meta = meta
        self._observe_in(meta, observed if self.method is not None else frozenset())
        if self.score_sums is not None and meta.num_decode_tokens:
            self._score_columns = int(meta.groups[0].decode_kv_indptr[-1]) * self.block_size
        if self.latent is not None:
            self.latent.plan(meta, self.sm_scale, self.method)
            return
        tails = self._tail_index(meta) if self.pool.store.has_tail else None
        for g, group in enumerate(meta.groups):
            for window in {self._layer_window.get(layer) for layer in group.layers}:
                self._plan_of(window, g).plan(group, meta, self.shape, self.sm_scale, tails)
        if self.pool.kmin is not None:
            # A decode-only step writes one token per request, each into its own block: the summaries
            # follow from the slot mapping on the device (graph-safe). Prefill chunks recompute blocks.
            decode_only = meta.num_prefill_requests == 0
            self._touched = None if decode_only else [self._touched_blocks(group, meta) for group in meta.groups]
        for selective in self._selectives:
            selective.reset()
        if self.method is None or self.lanes > 1:  # a head-major layer reads every slot its lanes hold
            return
        for g, group in enumerate(meta.groups):
            if all(layer in self._layer_window for layer in group.layers):
                continue  # windowed layers attend densely
            dense = self._plans[g].decode
            table = dense.planned_kv_indices() if meta.num_decode_tokens and dense.backend == "triton" else None
            decode_tails = None if tails is None else tails[1][: meta.num_decode_tokens]
            self._selective_of(g).plan_step(self.method, meta, group, table=table, tail_index=decode_tails)

    @property
    def selective(self) -> SelectiveDecode:
        """The first layer group's selective decode (the only one without per-layer tables)."""
        return self._selectives[0]

    def _selective_of(self, g: int) -> SelectiveDecode:
        while len(self._selectives) <= g:
            self._selectives.append(SelectiveDecode(self.device, self.shape, self.sm_scale))
        return self._selectives[g]

    def _new_plan(self, window: int | None, g: int) -> _GroupPlan:
        caps = self._caps if g < self._num_graph_groups else ()
        if window is None:
            return _GroupPlan(self.device, self._make_prefill, *caps)
        plan = _GroupPlan(self.device, BatchPrefillWithPagedKVCache, *caps)
        plan.window_left = window
        return plan

    def _plan_of(self, window: int | None, g: int) -> _GroupPlan:
        """Group ``g``'s plan for layers with ``window`` (None: full attention), made on first use."""
        plans = self._plans if window is None else self._window_plans[window]
        if g not in plans:
            plans[g] = self._new_plan(window, g)
        return plans[g]

    def _tail_index(self, meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token row's and each item's tail row, int32 on the host. A padded decode graph has
        more decode rows than items: its dummy rows get row 0 (never written: their slot is -1)."""
        per_item = [self.tail_rows.row(step.request_id) for step in meta.steps]
        rows = torch.zeros(meta.num_tokens, dtype=torch.int32)
        for start, step, row in zip(meta.row_starts, meta.steps, per_item, strict=True):
            rows[start : start + step.num_new_tokens] = row
        nd = meta.num_decode_tokens
        decode = per_item[:nd] + [0] * (nd - len(per_item[:nd]))
        return rows, torch.tensor(decode + per_item[nd:], dtype=torch.int32)

    def _touched_blocks(self, group: LayerGroupMetadata, meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks this step writes in the group's layers, and how many valid tokens each then holds."""
        bs = self.block_size
        blocks, valid = [], []
        for i, step in enumerate(meta.steps):
            start, end = group.kv_lens[i], group.kv_lens[i] + step.num_new_tokens
            for b in range(start // bs, (end - 1) // bs + 1):
                blocks.append(group.block_ids[i][b])
                valid.append(min(bs, end - b * bs))
        return (
            to_device(torch.tensor(blocks, dtype=torch.int32), self.device),
            to_device(torch.tensor(valid, dtype=torch.int32), self.device),
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """``sparse_models.AttentionBackend.forward``: a plain store without block summaries rotates and stores
        in one launch (``rope_store``); the others rotate first."""
        if abs(scale - self.sm_scale) > 1e-12 * self.sm_scale:
            raise ValueError(f"attention scale {scale} differs from the planned {self.sm_scale}")
        meta = self._meta
        group_idx = meta.layer_group[layer_idx]
        summary = self.pool.summary(layer_idx) if self._plain else None
        if rotation is not None and (not self._plain or summary is not None):
            q, k = rotation.apply(q, k)
            rotation = None
        if self.latent is not None:
            return self._forward_latent(layer_idx, group_idx, q, k)
        window = self._layer_window.get(layer_idx)
        plan = self._plans[group_idx] if window is None else self._window_plans[window][group_idx]
        if self.quantized is not None:
            return self._forward_quantized(layer_idx, plan, meta.groups[group_idx], q, k, v)
        if self.lanes > 1:
            return self._forward_lanes(layer_idx, plan, meta.groups[group_idx], q, k, v)
        k_cache, v_cache = self.pool.k[layer_idx], self.pool.v[layer_idx]
        ring_copy = self._ring_copy(layer_idx, q, window)
        group = meta.groups[group_idx]
        if rotation is not None:  # no summary: rotated, stored and the decode queries recorded in one launch
            copy = dict(copy_into=ring_copy["copy_into"], copy_index=ring_copy["copy_index"]) if ring_copy else {}
            num_copy = ring_copy["copy_rows"].shape[0] if ring_copy else 0
            q = rope_store(q, k, v, rotation, k_cache, v_cache, plan.slot_mapping, **copy, num_copy=num_copy)
        else:
            # Decode-only steps: the summaries follow the slot mapping, updated in the store's launch.
            from_slots = summary if summary is not None and self._touched is None else None
            store_kv(k, v, k_cache, v_cache, plan.slot_mapping, **ring_copy, summary=from_slots)
        if summary is not None and self._touched is not None:
            kmin, kmax, kscale = summary
            blocks, valid = self._touched[group_idx]
            block_summary(k_cache, blocks, valid, kmin, kmax, scale=kscale)
        nd = meta.num_decode_tokens
        has_prefill = meta.num_prefill_requests > 0
        method = self.method if window is None else None  # sparse methods act on full-attention layers only
        layer = DENSE_LAYER if method is None else method.layer_plan(layer_idx)
        select_decode = nd > 0 and layer.selects_decode
        select_prefill = has_prefill and layer.prefill
        scores = self._scores_out(nd, window)
        if not has_prefill and not select_decode:
            out = plan.decode.run(q, k_cache, v_cache, scores_out=scores)
        elif nd == 0 and not select_prefill:
            out = plan.prefill.run(q, k_cache, v_cache)
        else:
            out = torch.empty_like(q)  # both kernels write their rows in place: no concatenation copy
            if select_decode:
                selective = self._selectives[group_idx]
                kmin, kmax, kscale = summary or (None, None, None)
                if selective.reads_all:  # no row selects this step: the dense plan
                    plan.decode.run(q[:nd], k_cache, v_cache, out=out[:nd])
                else:
                    # Tensor parallelism: the method sees the query heads of this rank's KV groups.
                    extra = {} if self.group_queries is None else {"select_q": self.group_queries(q[:nd])}
                    args = (method, layer_idx, q[:nd], k_cache, v_cache, kmin, kmax, out[:nd])
                    selective.run_batched(
                        *args, dense=plan.decode, kscale=kscale, **extra
                    )  # picked on the device, no host sync
            elif nd:
                plan.decode.run(q[:nd], k_cache, v_cache, out=out[:nd], scores_out=scores)
            if select_prefill:
                self.selective_prefill.run(method, layer_idx, q[nd:], k_cache, v_cache, meta, group, out[nd:])
            elif has_prefill:
                plan.prefill.run(q[nd:], k_cache, v_cache, out=out[nd:])
        if scores is not None:
            self.score_sums.add_decode(layer_idx)
        if window is None:  # sparse methods act on full-attention layers only
            self._hand_over(layer_idx, q, k_cache, group, recorded=bool(ring_copy), v_cache=v_cache)
        return out

    def _ring_copy(self, layer_idx: int, q: torch.Tensor, window: int | None) -> dict:
        """``store_kv``'s copy arguments that write a full-attention layer's decode queries into the ring
        in the store's launch (one launch per layer fewer); empty when the ring takes them otherwise
        (``_hand_over``: grouped query heads under tensor parallelism) or not at all."""
        ring, nd = self.query_ring, self._meta.num_decode_tokens
        if ring is None or not nd or window is not None or self.group_queries is not None:
            return {}
        if ring.queries[layer_idx].dtype != q.dtype:
            return {}
        return {"copy_rows": q[:nd], "copy_into": ring.queries[layer_idx], "copy_index": ring.dest}

    def _scores_out(self, nd: int, window: int | None) -> torch.Tensor | None:
        """Where a full-attention layer's decode kernel writes its scores for the method's running sums."""
        if self.score_sums is None or not nd or window is not None:
            return None
        if self._score_columns > self.score_sums.max_columns:
            return None  # the method observes this step's decode rows through the host path instead
        return self.score_sums.scores[:, : self._score_columns]

    def _hand_over(
        self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor | None, group, recorded: bool = False, v_cache=None
    ) -> None:
        """After a layer's attention: record the decode rows' queries in the ring unless the store did
        (``recorded``; device only, also while a CUDA graph is captured), then hand the method the
        attention inputs it asked for."""
        nd = self._meta.num_decode_tokens
        if self.query_ring is not None and nd and not recorded:
            rows = q[:nd] if self.group_queries is None else self.group_queries(q[:nd])
            self.query_ring.record(layer_idx, rows)
        if self.method is not None and self._observed:
            self._observe(layer_idx, q, k_cache, group, self._observed, v_cache)

    def _forward_latent(self, layer_idx: int, group_idx: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A latent store: ``rows [T, 1, D]`` are the cached rows (their values are a prefix of them)."""
        out = self.latent.forward(layer_idx, group_idx, q, rows)
        if self._observed:
            self._observe(layer_idx, q, self.pool.latent[layer_idx], self._meta.groups[group_idx], self._observed)
        return out

    def _forward_quantized(self, layer_idx: int, plan: _GroupPlan, group, q, k, v) -> torch.Tensor:
        """A quantized store: encode the new K/V on write, attend over codes (dequantized in the kernels)."""
        meta = self._meta
        kv = self.quantized[layer_idx]
        static = None if self.static_scales is None else self.static_scales[layer_idx]
        decode_only = meta.num_prefill_requests == 0
        store_kv_quantized(
            k, v, kv, plan.slot_mapping, plan.tail_index, one_row_per_request=decode_only, static_scales=static
        )
        summary = self.pool.summary(layer_idx)
        kmin, kmax, kscale = summary or (None, None, None)
        levels = self.pool.store.page_stat_levels
        if levels:  # KIVI: each full page's key statistics bound it (written when the page is encoded)
            kmin, kmax = kv.k_min, kv.k_scale
        if summary is not None:  # page summaries of the dequantized keys (a selection reads them)
            g = meta.layer_group[layer_idx]
            if self._touched is not None:  # prefill chunks: the blocks the step writes (host-built)
                blocks, valid = self._touched[g]
            else:  # a decode step: each row's block through its newest token, from the slot mapping
                if layer_idx == meta.groups[g].layers[0] or g not in self._slot_blocks:
                    # once per forward and layer group (a graph's warm-up and capture each run it again)
                    slots, bs = plan.slot_mapping.to(torch.int64), self.block_size
                    self._slot_blocks[g] = (slots.clamp(min=0) // bs, torch.where(slots >= 0, slots % bs + 1, 0))
                blocks, valid = self._slot_blocks[g]
            quantized_block_summary(kv, blocks, valid, kmin, kmax, scale=kscale)
        nd = meta.num_decode_tokens
        layer = DENSE_LAYER if self.method is None else self.method.layer_plan(layer_idx)
        select_decode = nd > 0 and layer.selects_decode
        if decode_only and not select_decode:
            out = plan.decode.run_quantized(q, kv)
        else:
            out = torch.empty_like(q)
            selective = self._selectives[meta.layer_group[layer_idx]] if select_decode else None
            if selective is not None and not selective.reads_all:
                extra = {} if self.group_queries is None else {"select_q": self.group_queries(q[:nd])}
                args = (self.method, layer_idx, q[:nd], None, None, kmin, kmax, out[:nd])
                selective.run_batched(*args, dense=plan.decode, kv=kv, kscale=kscale, levels=levels, **extra)
            elif nd:
                plan.decode.run_quantized(q[:nd], kv, out=out[:nd])
            if not decode_only:
                plan.prefill.run_quantized(q[nd:], kv, out=out[nd:])
        self._hand_over(layer_idx, q, None, group)
        return out

    def _forward_lanes(self, layer_idx: int, plan: _GroupPlan, group, q, k, v) -> torch.Tensor:
        """A head-major store: rows are (request, KV head) lanes. ``q [T, Hkv * G, D]`` viewed as
        ``[T * Hkv, G, D]`` is token-major; decode rows are already in lane order, prefill rows are
        gathered into it (``group.prefill_rows``) and their outputs scattered back."""
        meta, h = self._meta, self.lanes
        k_cache, v_cache = self.pool.k[layer_idx], self.pool.v[layer_idx]  # [N, bs, 1, D]
        t, d = k.shape[0], k.shape[-1]
        store_kv(k.reshape(t * h, 1, d), v.reshape(t * h, 1, d), k_cache, v_cache, plan.slot_mapping)
        rows = q.reshape(t * h, -1, q.shape[-1])
        out = torch.empty_like(rows)
        nd = meta.num_decode_tokens * h
        if nd:
            plan.decode.run(rows[:nd], k_cache, v_cache, out=out[:nd])
        if meta.num_prefill_requests:
            order = plan.prefill_rows(group) + nd
            out[order] = plan.prefill.run(rows[order], k_cache, v_cache)
        self._hand_over(layer_idx, q, k_cache, group)
        return out.view_as(q)

    def _lane_keys(self, group, i: int, n: int, flat_k: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """Request ``i``'s keys ``[kv_len, Hkv, D]`` in a head-major layer, after this step's ``n`` tokens,
        and None; or, when its heads hold different counts, the padded keys ``LayerAttention.head_lens``
        describes (each head's earlier slots first, the step's tokens last) and those counts."""
        h, bs = self.lanes, self.block_size
        lens = tuple(group.kv_lens[i * h + j] + n for j in range(h))
        width = max(lens)
        # Per head, the pool slots of its rows: its earlier slots, padding (its first slot, zeroed below), the step's.
        rows = []
        for j, kv_len in enumerate(lens):
            slots = table_slots(group.block_ids[i * h + j], kv_len, bs)
            rows.append(torch.cat([slots[: kv_len - n], slots[:1].expand(width - kv_len), slots[kv_len - n :]]))
        keys = flat_k[to_device(torch.stack(rows), self.device)].squeeze(2).transpose(0, 1)  # [width, H, D]
        if len(set(lens)) == 1:
            return keys, None
        for j, kv_len in enumerate(lens):
            keys[kv_len - n : width - n, j] = 0
        return keys, lens

    def _request_keys(
        self, layer_idx: int, group, i: int, kv_len: int, flat_k: torch.Tensor | None, dtype
    ) -> torch.Tensor:
        """Request ``i``'s keys in this layer, in slot order ``[kv_len, Hkv, D]`` (dequantized from codes
        for quantized stores, with a tailed store's incomplete page from the request's tail row); a plain
        store's values likewise when ``flat_k`` is the flat value pool."""
        meta = self._meta
        if flat_k is not None:
            key = (id(group.block_ids[i]), i, kv_len)  # a table per layer in the per-layer layout
            slots = self._observed_slots.get(key)
            if slots is None:  # once per request, table and step
                host = table_slots(group.block_ids[i], kv_len, self.block_size)
                slots = self._observed_slots[key] = to_device(host, self.device)  # pinned, no wait
            return flat_k[slots]
        kv, bs = self.quantized[layer_idx], self.block_size
        blocks = to_device(torch.tensor(group.block_ids[i][: -(-kv_len // bs)], dtype=torch.int64), self.device)
        keys = dequantize_blocks(kv, blocks, dtype=dtype)[0].flatten(0, 1)[:kv_len]
        partial = kv_len % bs
        if kv.has_tail and partial:
            row = self.tail_rows.row(meta.steps[i].request_id)
            keys = torch.cat([keys[: kv_len - partial], kv.k_tail[row, :partial].to(keys.dtype)])
        return keys

    def _observe(
        self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor | None, group, wanted, v_cache=None
    ) -> None:
        """Hand the method every wanted request's queries and keys in this layer (slot order) in one call:
        for decode rows over a plain store also as tensors, the keys left in their pages; the values too
        where the method observes them (``observes_values``: over a plain store with a table per request,
        the stores of the query-aware methods; None elsewhere)."""
        meta = self._meta
        index = self._observed_index
        if not index:
            return
        flat_k = None if k_cache is None else k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        plain = flat_k is not None and self.lanes == 1 and self.latent is None
        v_cache = v_cache if plain and self.method.observes_values else None
        flat_v = None if v_cache is None else v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])

        def view(j: int) -> LayerAttention:  # request ``index[j]``'s own view
            i, head_lens, vals = index[j], None, None
            step = meta.steps[i]
            if self.lanes > 1:
                keys, head_lens = self._lane_keys(group, i, step.num_new_tokens, flat_k)
            else:
                kv_len = group.kv_lens[i] + step.num_new_tokens
                keys = self._request_keys(layer_idx, group, i, kv_len, flat_k, q.dtype)
                if flat_v is not None:
                    vals = self._request_keys(layer_idx, group, i, kv_len, flat_v, q.dtype)
            rows = q[meta.row_starts[i] : meta.row_starts[i] + step.num_new_tokens]
            rows = rows if self.group_queries is None else self.group_queries(rows)
            return LayerAttention(rows, keys, self.sm_scale, head_lens, vals)

        queries, keys = None, None
        rows = self._observed_rows_of(group) if self.lanes == 1 and flat_k is not None and not self.latent else None
        if rows is not None:
            queries = q[: meta.num_decode_tokens][rows.rows]
            queries = (queries if self.group_queries is None else self.group_queries(queries)).unsqueeze(1)
            keys = rows.keys(k_cache, v_cache)
        steps = tuple(meta.steps[i] for i in index)
        self.method.on_attention_end(layer_idx, LayerAttentionBatch(steps, self.sm_scale, view, queries, keys))

    @property
    def observes_stored(self) -> bool:
        """The method's observation can wait for the step's end (``observe_stored``): it reads no queries and the
        store keeps plain keys on one lane, without tensor parallelism's query regrouping."""
        method = self.method
        return method is not None and not method.observes_queries and self._plain and self.group_queries is None

    def observe_stored(self, meta: StepMetadata, observed: Collection[Hashable]) -> None:
        """After a step's forward (or its graph's replay, which observed nothing): hand the method each
        full-attention layer's ``observed`` requests as ``on_attention_end`` would have during the forward,
        their keys and values read from the pool (where the step's own are stored by now) and their queries
        without heads (``observes_stored``)."""
        if not self.observes_stored:
            raise RuntimeError("the method observes queries or the store is not plain: observe during the forward")
        self._meta = meta
        self._observe_in(meta, observed)
        if not self._observed_index:
            return
        k_cache = self.pool.k[0]
        q = k_cache.new_empty((meta.num_tokens, 0, k_cache.shape[-1]))
        for layer_idx in range(len(self.pool.k)):
            if layer_idx not in self._layer_window:  # sparse methods act on full-attention layers only
                group = meta.groups[meta.layer_group[layer_idx]]
                self._observe(layer_idx, q, self.pool.k[layer_idx], group, observed, self.pool.v[layer_idx])

    def _observe_in(self, meta: StepMetadata, observed: Collection[Hashable]) -> None:
        """The requests of ``meta`` whose attention the method observes, and fresh per-step lookups for them."""
        self._observed_slots, self._observed_tables = {}, {}
        self._observed = observed
        self._observed_index = [i for i, step in enumerate(meta.steps) if step.request_id in observed]

    def _observed_rows_of(self, group) -> ObservedRows | None:
        """The observed decode rows' block tables in ``group`` (once per group and step)."""
        key = id(group)
        if key not in self._observed_tables:
            self._observed_tables[key] = observed_rows(group, self._observed_index, self.block_size, self.device)
        return self._observed_tables[key]
