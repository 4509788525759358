"""Decode steps under CUDA graphs, one graph per batch-size bucket.

A decode-only step (every item one token, the layer groups the graphs were captured with: one, or
one per layer in the per-layer layout; no method asking to observe attention) is padded to the next
captured batch size: padded rows get token 0 at position 0, slot -1 (the KV store skips it) and a
one-token KV list on block 0 (read, never written; their outputs are dropped); a head-major store's
groups pad a row per KV head of each padded request likewise. The graph reads its
inputs from static buffers that each step fills in place: the token ids and positions here, each
group's slot mapping and decode CSR inside the attention backend (whose plans copy into
fixed-capacity buffers). Logits and sampling run eagerly on the real rows. A method's query ring
(``sparse_methods.QueryRing``: an evicting method's recent decode queries) is written inside the
graphs from its fixed index buffer, so an evicting method's steps between compactions replay too.

Tensor parallelism: each rank captures the same buckets with its NCCL collectives inside (the
communicator already initialised by the warm-up forwards); rank 0 broadcasts every step, so every
rank pads to the same bucket, captures a selecting graph at the same step and replays the same graph
in the same order. Those captures are thread-local: the NCCL process group's watchdog thread may
query events of work enqueued before a capture while it runs, which a process-wide (global) capture
mode forbids (nccl-tests captures thread-local for the same reason).

MLA (a latent store) replays the same way: ``LatentPagedAttention`` keeps its decode plan in fixed
buffers, and Quest on the latent selects through the same ``SelectiveDecode`` batched path
(``attention.selective`` is the latent backend's).

Block summaries (query-aware stores) are updated inside the graph from the static slot mapping.
Steps of a method that selects what decode reads (on the device, ``select_decode``) are eligible when
every request of the step selects alike: all read everything (the plain
bucket graph, captured without the method, serves them), or all read the same number of entries.
The latter are captured lazily, per (bucket, the selective plan's ``graph_key``), from the first
such step: one eager warm-up forward of that step (a real run: replaying it rewrites the same KV and
summaries), then the capture, then the replay. The selecting layers' plan lives in fixed buffers
(see ``SelectiveDecode``); the graph's padding rows select on a one-token table and are dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

import torch

from sparse_models.distributed import tp_world_size
from sparse_serve.step_metadata import LayerGroupMetadata, StepMetadata

EXACT_GRAPH_SIZES = 32


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Captured sizes: every size up to ``EXACT_GRAPH_SIZES`` (32), then every multiple of 8 up to
    ``max_batch_size`` (and it).

    Batches up to 32 get their own graph. A padding row costs little on the dense path (a one-token
    list) but as much as a real row's selection and sparse read on a selecting one (a batch of 5 in
    a graph of 8 selected and read 8 rows' budgets per layer). And the decode kernels' split count is
    fixed when a graph is captured, for the graph's row count: a batch padded to a larger graph runs
    fewer programs per list than its own size would (fp8_kv at its largest batch, 11, in the 16-row
    graph: 33 splits instead of 48, 45.8 ms a step; in an 11-row graph 39.3 ms, the quantized decode
    kernel 41.7 -> 31.8 ms; H200, Qwen3-8B shape, 128K, session 24). Past 32 rows a graph launches
    thousands of decode programs a layer either way, so padding to the next multiple of 8 costs little."""
    sizes = list(range(1, min(EXACT_GRAPH_SIZES, max_batch_size) + 1))
    sizes += range(EXACT_GRAPH_SIZES + 8, max_batch_size + 1, 8)  # EXACT_GRAPH_SIZES is a multiple of 8
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def _pad_group(group: LayerGroupMetadata, pad: int) -> LayerGroupMetadata:
    """``pad`` dummy requests: a row each, or one per KV head of a head-major group."""
    rows, last = pad * group.heads, int(group.decode_kv_indptr[-1])
    return LayerGroupMetadata(
        layers=group.layers,
        kv_lens=group.kv_lens + (0,) * rows,
        block_ids=group.block_ids,  # the real rows' (what host-side readers of a graphed step index)
        slot_mapping=torch.cat([group.slot_mapping, torch.full((rows,), -1, dtype=torch.int32)]),
        decode_kv_indptr=torch.cat([group.decode_kv_indptr, last + torch.arange(1, rows + 1, dtype=torch.int32)]),
        decode_kv_indices=torch.cat([group.decode_kv_indices, torch.zeros(rows, dtype=torch.int32)]),
        decode_kv_last_len=torch.cat([group.decode_kv_last_len, torch.ones(rows, dtype=torch.int32)]),
        prefill_qo_indptr=group.prefill_qo_indptr,
        prefill_kv_indptr=group.prefill_kv_indptr,
        prefill_kv_indices=group.prefill_kv_indices,
        prefill_kv_last_len=group.prefill_kv_last_len,
        heads=group.heads,
    )


def pad_decode_metadata(meta: StepMetadata, batch_size: int) -> StepMetadata:
    """``meta`` (decode-only) padded with dummy requests to ``batch_size`` rows, in every layer group."""
    pad = batch_size - meta.num_tokens
    zeros = torch.zeros(pad, dtype=torch.int64)
    return StepMetadata(
        input_ids=torch.cat([meta.input_ids, zeros]),
        positions=torch.cat([meta.positions, zeros]),
        num_decode_tokens=batch_size,
        num_prefill_requests=0,
        groups=tuple(_pad_group(group, pad) for group in meta.groups),
        layer_group=meta.layer_group,
        steps=meta.steps,
        row_starts=meta.row_starts,
        logits_indices=meta.logits_indices,
        sampled=meta.sampled,
    )


def _dummy_decode_metadata(batch_size: int, layer_group: tuple[int, ...], heads: int = 1) -> StepMetadata:
    """A decode step of ``batch_size`` padding rows only (what a capture runs), with ``layer_group``'s groups
    (``heads``: their lanes per request, a head-major store's KV heads)."""
    empty = torch.zeros(0, dtype=torch.int32)
    groups = tuple(
        LayerGroupMetadata(
            layers=tuple(layer for layer, g in enumerate(layer_group) if g == group),
            kv_lens=(),
            block_ids=(),
            slot_mapping=empty,
            decode_kv_indptr=torch.zeros(1, dtype=torch.int32),
            decode_kv_indices=empty,
            decode_kv_last_len=empty,
            prefill_qo_indptr=torch.zeros(1, dtype=torch.int32),
            prefill_kv_indptr=torch.zeros(1, dtype=torch.int32),
            prefill_kv_indices=empty,
            prefill_kv_last_len=empty,
            heads=heads,
        )
        for group in range(max(layer_group) + 1)
    )
    meta = StepMetadata(
        input_ids=torch.zeros(0, dtype=torch.int64),
        positions=torch.zeros(0, dtype=torch.int64),
        num_decode_tokens=0,
        num_prefill_requests=0,
        groups=groups,
        layer_group=layer_group,
        steps=(),
        row_starts=(),
        logits_indices=torch.zeros(0, dtype=torch.int64),
        sampled=(),
    )
    return pad_decode_metadata(meta, batch_size)


class DecodeGraphs:
    """Captures the model's decode forward per batch bucket and replays it for eligible steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        attention,
        num_layers: int,
        max_batch_size: int,
        device,
        layer_group: tuple[int, ...] | None = None,
        heads: int = 1,
    ):
        """``layer_group``: each layer's group in the steps captured (default: one group for all layers);
        ``heads``: rows per request in each group (a head-major store's KV heads)."""
        self.model = model
        self.attention = attention
        self.num_layers = num_layers
        self.layer_group = layer_group or (0,) * num_layers
        self.heads = heads
        self.sizes = graph_batch_sizes(max_batch_size)
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.selecting_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (bucket, graph_key) -> graph
        self.selecting_outputs: dict[tuple, torch.Tensor] = {}
        self.pool = None
        self.num_replays = 0
        self._capture_mode = "thread_local" if tp_world_size() > 1 else "global"

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        method, self.attention.method = self.attention.method, None  # captures never observe
        try:
            for bs in reversed(self.sizes):
                self.attention.plan(_dummy_decode_metadata(bs, self.layer_group, self.heads))
                ids, pos = self.input_ids[:bs], self.positions[:bs]
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    self.model(ids, pos, self.attention)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self._capture_mode):
                    self.outputs[bs] = self.model(ids, pos, self.attention)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
            torch.cuda.synchronize()
        finally:
            self.attention.method = method

    def bucket(self, num_tokens: int) -> int | None:
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def eligible(self, meta: StepMetadata, method, observed: Collection[Hashable] = frozenset()) -> bool:
        """Whether the step replays a graph: decode only, within a bucket, observing nothing during the forward
        (``observed``: what the method's ``prepare_step`` returned, less what it observes from the pool after the
        step, ``PagedAttention.observe_stored``), every request selecting alike."""
        if meta.num_prefill_requests or meta.layer_group != self.layer_group or self.bucket(meta.num_tokens) is None:
            return False
        if len(meta.sampled) != meta.num_tokens:  # a one-token prefill chunk that samples nothing
            return False
        if method is None:
            return True
        if observed:
            return False
        plans = [method.layer_plan(layer) for layer in range(self.num_layers)]
        if any(plan.selects_decode for plan in plans):
            if len(meta.groups) > 1:
                return False  # selecting graphs: one group only, for now
            _, uniform = self.attention.selective.uniform_size(method, meta, meta.groups[0])
            return uniform
        return True

    def run(self, meta: StepMetadata, feed=None) -> torch.Tensor:
        """Replay the bucket's graph for an eligible step; returns hidden states of the real rows.

        ``feed`` (a ``sampler.TokenFeed``): rows whose token the previous step sampled on the device,
        copied into the static ids after the host ids (same stream, so after that step's sampling)."""
        n = meta.num_tokens
        bs = self.bucket(n)
        padded = pad_decode_metadata(meta, bs)
        self.input_ids[:bs].copy_(padded.input_ids.pin_memory(), non_blocking=True)
        if feed is not None:
            feed.apply_(self.input_ids)
        self.positions[:bs].copy_(padded.positions.pin_memory(), non_blocking=True)
        self.attention.plan(padded)
        selective = self.attention.selective
        key = selective.graph_key() if self.attention.method is not None else None
        if key is None and selective.batched:  # planned off the graph path after all: run it eagerly
            return self.model(self.input_ids[:bs], self.positions[:bs], self.attention)[:n]
        if key is None:  # no row selects, or no method: the bucket's plain graph
            self.graphs[bs].replay()
            self.num_replays += 1
            return self.outputs[bs][:n]
        key = (bs, *key)
        if key not in self.selecting_graphs:
            self._capture_selecting(key, bs)
        self.selecting_graphs[key].replay()
        self.num_replays += 1
        return self.selecting_outputs[key][:n]

    @torch.inference_mode()
    def _capture_selecting(self, key: tuple, bs: int) -> None:
        """Capture the planned selecting step (inputs already in the static buffers)."""
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        self.model(ids, pos, self.attention)  # warm-up: Triton compiles; a real, repeatable run of the step
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self._capture_mode):
            self.selecting_outputs[key] = self.model(ids, pos, self.attention)
        self.selecting_graphs[key] = graph
