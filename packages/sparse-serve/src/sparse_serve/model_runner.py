"""Runs one step on the model: metadata to the device, forward, logits, sample."""

from __future__ import annotations

import time
from collections.abc import Collection, Hashable

import torch

from sparse_cache import SUMMARY_TENSORS, LayerLayout, TailRows
from sparse_kernels import block_summary
from sparse_kernels.block_summary import quantized_block_summary
from sparse_kernels.prefix_attention import warm_plans
from sparse_methods import (
    ClusterArena,
    DecodeRead,
    DecodeScoreSums,
    DeviceState,
    QueryRing,
    SparseMethod,
    StepContext,
    StoreKind,
    Support,
)
from sparse_models import ModelConfig, load_model
from sparse_models.distributed import (
    gather_kv_group_heads,
    min_over_ranks,
    rank_attention_config,
    tp_rank,
    tp_world_size,
)
from sparse_serve.config import EngineConfig
from sparse_serve.cuda_graphs import DecodeGraphs
from sparse_serve.kv_pool import allocate_kv_pool, bytes_per_block, num_blocks_for_budget, store_kind
from sparse_serve.paged_attention import PagedAttention
from sparse_serve.sampler import PromptRows, SampledTokens, Sampler, TokenFeed, prompt_token_logprobs
from sparse_serve.step_metadata import StepMetadata, to_device

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    if name == "cuda" and tp_world_size() > 1:
        return torch.device("cuda", tp_rank())  # rank r on cuda:r
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_dtype: str | None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(model_dtype).removeprefix("torch."), torch.bfloat16)


class ModelRunner:
    """Owns the model, the KV pool and the sampler on one device."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len_hint: int,
        method: SparseMethod | None = None,
        layout: LayerLayout | None = None,
    ):
        """``layout``: the tables of a request's layers (default shared); in the per-layer layout the pool
        holds ``num_blocks`` blocks per layer in one tensor per kind (``num_pool_blocks`` ids in all)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.torch_dtype)
        self.model, self.model_config = load_model(
            config.model, dtype=self.dtype, device=self.device, load_format=config.load_format, seed=config.seed
        )
        cfg = self.model_config
        # This rank's heads: what its KV pool holds and its kernels attend (all heads on one rank).
        self.rank_config = heads = rank_attention_config(cfg)
        self.block_size = config.block_size
        self.store = store_kind(
            method,
            heads,
            config.block_size,
            config.resolved_kv_cache_dtype(),
            kivi_bits=config.kivi_bits,
            turboquant_bits=config.turboquant_bits,
            turboquant_seed=config.turboquant_seed,
        )
        self.summaries = self.store.summaries
        _check_method_over_store(method, self.store, cfg.num_hidden_layers)
        _check_windows(method, self.store, cfg)
        # One tail row per running request (KIVI's incomplete page), taken on its first write.
        self.num_tail_rows = config.max_num_seqs if self.store.has_tail else 0
        self.tail_rows = TailRows(self.num_tail_rows) if self.store.has_tail else None
        # A head-major store's block is one (layer, KV head) lane's: ``lanes`` of them hold a token in a layer.
        self.lanes = layout.heads if layout is not None else 1
        # Before the pool takes the free memory: the method's ring of recent decode queries or its running
        # decode scores (``device_state``, asked once), or its cluster indexes, if it keeps them.
        wants = DeviceState() if method is None else method.device_state()
        self.query_ring = _query_ring(method, wants.query_window, self.store, config, self.dtype, self.device)
        per_layer = layout is not None and layout.per_layer
        sums = None if per_layer else wants.score_sums
        self.score_sums = _decode_score_sums(method, sums, self.store, config, self.device)
        graph_batch = min(config.max_cuda_graph_batch_size, config.max_num_seqs)
        _cluster_arena(method, config, max_model_len_hint, graph_batch, self.dtype, self.device)
        start = time.perf_counter()
        self.cascade_plans = self._warm_cascade_plans(max_model_len_hint)
        self.cascade_plans_s = time.perf_counter() - start  # start-up time they took (reported by the bench)
        self.num_blocks = min_over_ranks(self._num_blocks(max_model_len_hint))  # one scheduler for all ranks
        self.num_pool_blocks = self.num_blocks * (layout.num_tables if per_layer else 1)
        self.kv = allocate_kv_pool(
            self.store,
            cfg.num_hidden_layers,
            self.num_blocks,
            self.dtype,
            self.device,
            self.num_tail_rows,
            one_tensor=per_layer,
            tables_per_layer=self.lanes,
        )
        static_scales = _static_fp8_scales(config.fp8_kv_scale_path, cfg.num_hidden_layers)
        lanes = self.lanes  # a head-major decode has a row per (request, KV head)
        self.attention = PagedAttention(
            self.kv,
            num_q_heads=heads.num_attention_heads,
            num_kv_heads=heads.num_key_value_heads,
            head_dim=cfg.head_dim,
            block_size=self.block_size,
            method=method,
            tail_rows=self.tail_rows,
            static_scales=static_scales,
            max_num_tokens=max(config.max_num_batched_tokens, graph_batch) * lanes,
            max_batch_size=max(config.max_num_seqs, graph_batch) * lanes,
            max_num_pages=self._max_decode_pages(max_model_len_hint, graph_batch),
            sm_scale=cfg.softmax_scale,
            layer_windows=tuple(-1 if w is None else w - 1 for w in cfg.layer_sliding_windows),  # HF W: w - 1
            group_queries=None if tp_world_size() == 1 else _group_queries(cfg.num_key_value_heads),
            num_graph_groups=cfg.num_hidden_layers if per_layer else 1,
            query_ring=self.query_ring,
            score_sums=self.score_sums,
        )
        self.method = method
        self.observed: Collection[Hashable] = frozenset()  # what the current step observes (``prepare_step``)
        self.graphs: DecodeGraphs | None = None
        # Under tensor parallelism every rank captures the same buckets, NCCL collectives inside.
        if self.device.type == "cuda" and not config.enforce_eager:
            # A decode step's layer groups: one, or one per layer (each with its own table). A latent store
            # keeps only its first group's plan in fixed buffers: with a table per layer it decodes eagerly.
            layer_group = tuple(range(cfg.num_hidden_layers)) if per_layer and not self.store.latent else None
            self.graphs = DecodeGraphs(
                self.model, self.attention, cfg.num_hidden_layers, graph_batch, self.device, layer_group, lanes
            )
            self.graphs.capture()
        self.sampler = Sampler(config.seed, self.device)

    def _max_decode_pages(self, max_model_len: int, graph_batch: int) -> int:
        """Block ids one layer's decode step lists at most (its plans' fixed capacity): every request at full
        length, plus a graph's padding rows. A head-major layer lists each lane's blocks: bounded by the
        pool too (only chain forks list a shared block twice), which keeps a plan per layer affordable."""
        full = self.config.max_num_seqs * -(-max_model_len // self.block_size)
        if self.lanes == 1:
            return full + graph_batch
        return min(full * self.lanes, self.num_pool_blocks) + graph_batch * self.lanes

    def _warm_cascade_plans(self, max_model_len: int) -> int:
        """Build cuDNN's plans for the prefill chunks' cached-prefix shapes now (``prefix_attention.warm_plans``),
        before the pool takes the free memory, so that the first long prompts do not pay them (~2 s inside a
        first 128K prefill on an H200). A plain (bf16 / fp16) store only; how many were built (0 elsewhere)."""
        if self.device.type != "cuda" or self.store.quantized or self.store.latent or self.lanes != 1:
            return 0
        heads = self.rank_config
        built = warm_plans(
            self.config.max_num_batched_tokens,
            max_model_len - 1,
            heads.num_attention_heads,
            heads.num_key_value_heads,
            self.model_config.head_dim,
            self.dtype,
            self.device,
            sm_scale=self.model_config.softmax_scale,
        )
        torch.cuda.empty_cache()
        return built

    def _num_blocks(self, max_model_len: int) -> int:
        cfg, bs = self.model_config, self.config.block_size
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cpu":
            # No point in holding more than every running request at full length.
            cap = self.config.max_num_seqs * -(-max_model_len // bs)
            budget = int(self.config.cpu_kv_cache_gib * 2**30)
            return num_blocks_for_budget(
                self.store,
                cfg.num_hidden_layers * self.lanes,
                self.dtype,
                budget,
                cap,
                num_tail_rows=self.num_tail_rows,
            )
        free, total = torch.cuda.mem_get_info(self.device)
        # The weights are already loaded, so `free` excludes them; keep (1 - utilization) of the card
        # for others and a rough activation reserve for the largest step (measured in a later issue).
        activation_reserve = 64 * self.config.max_num_batched_tokens * cfg.hidden_size * 4
        kept_free = int(total * (1.0 - self.config.gpu_memory_utilization))
        budget = free - kept_free - activation_reserve
        try:
            return num_blocks_for_budget(
                self.store, cfg.num_hidden_layers * self.lanes, self.dtype, budget, num_tail_rows=self.num_tail_rows
            )
        except ValueError as e:  # say where the memory went: free after the weights, kept free, activations
            gib = 2**30
            raise ValueError(
                f"{e}: {free / gib:.1f} GiB free after the weights, {kept_free / gib:.1f} GiB kept free "
                f"(gpu_memory_utilization={self.config.gpu_memory_utilization}), {activation_reserve / gib:.1f} GiB "
                f"reserved for the activations of max_num_batched_tokens={self.config.max_num_batched_tokens}; "
                "lower max_num_batched_tokens or raise gpu_memory_utilization"
            ) from e

    @torch.inference_mode()
    def randomize_kv(self, seed: int = 0) -> None:
        """Fill the whole KV pool with unit-normal noise (benchmarks' synthetic prefill)."""
        g = torch.Generator(self.device).manual_seed(seed)
        if self.kv.quantized is not None:
            randomize_quantized(self.kv, g)
            if self.kv.kmin is not None:  # summaries of the noise's dequantized keys, a few thousand blocks at a time
                for layer, kv in enumerate(self.kv.quantized):
                    kmin, kmax, kscale = self.kv.summary(layer)
                    for start in range(0, self.kv.num_blocks, 4096):
                        ids = torch.arange(start, min(start + 4096, self.kv.num_blocks), device=self.device)
                        full = torch.full_like(ids, self.block_size)
                        quantized_block_summary(kv, ids, full, kmin, kmax, scale=kscale)
            return
        layers = self.kv.layers[:1] if self.kv.one_tensor else self.kv.layers
        for layer in layers:
            for cache in (layer["kv"],) if self.kv.store.latent else (layer["k"], layer["v"]):
                cache.normal_(generator=g)
        if self.kv.kmin is not None:  # block summaries follow the noise (Quest's bounds see real keys)
            blocks = torch.arange(self.kv.num_blocks, dtype=torch.int32, device=self.device)
            full = torch.full_like(blocks, self.block_size)
            for layer in layers:  # a latent store summarizes its rows (latent + rope)
                keys = layer["kv" if self.kv.store.latent else "k"]
                block_summary(keys, blocks, full, layer["kmin"], layer["kmax"], scale=layer.get("kscale"))

    @torch.inference_mode()
    def clear_block(self, block_id: int) -> None:
        """Zero one block in every tensor (the per-layer layout's null block: never written, and finite
        wherever a reference kernel gathers it before masking it out)."""
        for t in self.kv.block_tensors():
            t[block_id] = 0

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of every layer (what ``num_blocks`` counts; a head-major store's: every lane)."""
        return bytes_per_block(self.store, self.model_config.num_hidden_layers * self.lanes, self.dtype)

    @property
    def kv_bytes_per_pool_block(self) -> int:
        """Bytes of one id of the KV manager's pool: one layer's block in the per-layer layout."""
        return self.kv_bytes_per_block * self.num_blocks // self.num_pool_blocks

    def release(self, request_id) -> None:
        """A request finished, was aborted or preempted: give back what the runner holds for it."""
        if self.tail_rows is not None:
            self.tail_rows.release(request_id)

    @torch.inference_mode()
    def run(self, meta: StepMetadata, feed: TokenFeed | None = None, prompt_rows: tuple[PromptRows, ...] = ()):
        """Queue the step's forward and sampling on the device; returns one token per ``meta.sampled``
        request, which ``tolist()`` fetches (the host may do other work before that).

        ``feed``: rows of ``meta.input_ids`` that are placeholders for tokens the previous step
        sampled and that are taken from its device tensor (pipelined decode, see ``LLMEngine.step``).
        ``prompt_rows``: prompt rows whose log-probabilities requests asked for (prefill steps only);
        computed at once (host sync) into the result's ``prompt_logprobs``.
        """
        self.observed = frozenset() if self.method is None else self.method.prepare_step(StepContext(meta.steps))
        # A method that reads only stored keys observes after the forward, from the pool (graphs replay).
        after = bool(self.observed) and self.attention.observes_stored
        during = frozenset() if after else self.observed
        if self.graphs is not None and self.graphs.eligible(meta, self.method, during):
            hidden = self.graphs.run(meta, feed)  # decode-only: every row is sampled, in order
            if after:
                self.attention.observe_stored(meta, self.observed)
            logits = self.model.compute_logits(hidden)
        else:
            input_ids = to_device(meta.input_ids, self.device)
            if feed is not None:
                feed.apply_(input_ids)
            positions = to_device(meta.positions, self.device)
            self.attention.plan(meta, during)
            hidden = self.model(input_ids, positions, self.attention)
            if after:
                self.attention.observe_stored(meta, self.observed)
            computed = {
                r.request_id: prompt_token_logprobs(
                    self.model.compute_logits(hidden[r.start : r.start + len(r.targets)]), r
                )
                for r in prompt_rows
            }
            if not meta.sampled:
                return SampledTokens.empty().with_prompt_logprobs(computed)
            logits = self.model.compute_logits(hidden[to_device(meta.logits_indices, self.device)])
            requests = meta.sampled
            return self.sampler.sample(
                logits, [r.request_id for r in requests], [r.sampling_params for r in requests], requests
            ).with_prompt_logprobs(computed)
        requests = meta.sampled
        return self.sampler.sample(
            logits, [r.request_id for r in requests], [r.sampling_params for r in requests], requests
        )


def _group_queries(num_kv_heads: int):
    """Query heads of this rank's KV heads' groups, for what a method sees (see ``gather_kv_group_heads``)."""
    return lambda q: gather_kv_group_heads(q, num_kv_heads)


def _query_ring(
    method: SparseMethod | None, window: int, store, config: EngineConfig, dtype, device
) -> QueryRing | None:
    """The ring of ``window`` recent decode queries per (running request, layer) that decode steps write on the
    device (``DeviceState.query_window``), handed to the method; None when it keeps none or reads a latent
    store (whose absorbed queries it observes through the host path)."""
    if method is None or window == 0 or store.latent:
        return None
    shape, rows = method.shape, config.max_num_seqs
    ring = QueryRing(shape.num_layers, rows, window, shape.num_q_heads, shape.head_dim, rows, dtype, device)
    method.query_ring = ring
    return ring


def _decode_score_sums(
    method: SparseMethod | None, shape, store, config: EngineConfig, device
) -> DecodeScoreSums | None:
    """The running attention sums of ``shape`` (``DeviceState.score_sums``) an accumulating method keeps per
    (decoding request, layer), fed by the decode kernel's score output, handed to the method; None when it
    keeps none or the store's kernels write no scores (quantized, latent: the host path observes)."""
    if method is None or shape is None or store.quantized or store.latent:
        return None
    capacity, heads = shape
    m, rows = method.shape, config.max_num_seqs
    sums = DecodeScoreSums(m.num_layers, rows, capacity, heads, m.num_kv_heads, config.block_size, rows, device)
    method.decode_score_sums = sums
    return sums


def _cluster_arena(
    method: SparseMethod | None, config: EngineConfig, max_model_len: int, graph_batch: int, dtype, device
) -> ClusterArena | None:
    """The fixed device buffers of a ``StoreKind.CLUSTER_INDEX`` method's indexes, handed to the method: a row
    per running request, each sized by the method's memory plan for the longest context (never reallocated:
    CUDA graphs read them). A ValueError when they cannot be planned or do not fit."""
    if method is None or method.storage.kind is not StoreKind.CLUSTER_INDEX:
        return None
    plan = method.memory_plan(max_model_len, 0, config.max_num_batched_tokens)
    tokens, clusters = max(plan.peak_tokens), plan.index_clusters
    if clusters < 1:
        raise ValueError(
            f"{method.name}: its memory plan bounds no cluster index for a context of max_model_len={max_model_len} "
            "tokens, so the index buffers cannot be sized"
        )
    m, rows = method.shape, config.max_num_seqs
    sizes = (m.num_layers, rows, tokens, clusters, m.num_kv_heads, m.head_dim)
    codes = method.storage.summary_dtype == "int8"  # the centroids as int8 codes with a scale each
    if device.type == "cuda":
        need = ClusterArena.num_bytes(*sizes, dtype, centroid_codes=codes)
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            raise ValueError(
                f"{method.name}: the cluster index buffers for {rows} requests of {tokens} tokens need "
                f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free; lower max_num_seqs or max_model_len"
            )
    arena = ClusterArena(*sizes, dtype, device, plan_rows=max(rows, graph_batch), centroid_codes=codes)
    method.cluster_arena = arena
    return arena


def _check_windows(method: SparseMethod | None, store, cfg: ModelConfig) -> None:
    """Sliding-window layers attend densely over a plain store; a method must say it leaves them alone."""
    if all(w is None for w in cfg.layer_sliding_windows):
        return
    if store.quantized:
        raise ValueError(f"sliding-window layers ({cfg.architecture}) do not run over a {store.scheme} KV store yet")
    if method is not None and Support.SLIDING_WINDOW not in method.supports:
        raise ValueError(
            f"{method.name} does not support models with sliding-window layers ({cfg.architecture}) yet; "
            "methods that do act on the full-attention layers only"
        )


def _check_method_over_store(method: SparseMethod | None, store, num_layers: int) -> None:
    """Combinations of a method and a quantized store that are not built yet are clear errors."""
    if method is None or not store.quantized:
        return
    if method.prefill_attention is not None:
        raise ValueError(
            f"prefill_sparse_method {method.prefill_attention.name!r} reads a plain KV store; it does not run over "
            f"a {store.scheme} KV store yet"
        )
    plans = [method.layer_plan(layer) for layer in range(num_layers)]
    # Selection from page summaries alone runs over the quantized stores: the per-token ones keep summaries
    # of their dequantized keys, KIVI's page statistics are summaries. Layers that observe every token's
    # logits (and the layers reading what they chose) run over the per-token stores (fp8, TurboQuant): the
    # engine computes the logits and the attention from codes. Selections that read keys otherwise, or
    # select prefill history, do not yet.
    wants_summaries = method.storage.kind is StoreKind.PAGED_WITH_SUMMARIES
    from_summaries = (
        wants_summaries
        and (store.summaries or store.page_stat_levels > 0)
        and all(plan.decode is not DecodeRead.OBSERVED and not plan.decode_keys for plan in plans)
    )
    observed = [plan for plan in plans if plan.decode is DecodeRead.OBSERVED]
    from_logits = (
        store.scheme in ("fp8", "turboquant")
        and bool(observed)
        and all(plan.decode is DecodeRead.OBSERVED or not plan.decode_keys for plan in plans)
    )
    selects = any(p.selects_decode for p in plans)
    if any(plan.prefill for plan in plans) or (selects and not (from_summaries or from_logits)):
        raise ValueError(
            f"{method.name} selects what attention reads from keys or history; it does not run over a "
            f"{store.scheme} KV store yet (selection from page summaries does: fp8, turboquant and kivi; "
            "from every token's logits: fp8 and turboquant)"
        )


def _static_fp8_scales(path: str | None, num_layers: int) -> tuple[tuple[float, float], ...] | None:
    """fp8's static per-layer scales from a JSON file ``{"k": [...], "v": [...]}`` (dequant multipliers)."""
    if path is None:
        return None
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    try:
        ks, vs = [float(x) for x in data["k"]], [float(x) for x in data["v"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: expected {{'k': [floats], 'v': [floats]}} (one per layer): {e}") from None
    if len(ks) != num_layers or len(vs) != num_layers:
        raise ValueError(f"{path}: {len(ks)} k and {len(vs)} v scales for a model of {num_layers} layers")
    if min(ks + vs) <= 0:
        raise ValueError(f"{path}: scales must be positive")
    return tuple(zip(ks, vs, strict=True))


@torch.inference_mode()
def randomize_quantized(pool, g: torch.Generator) -> None:
    """Valid random codes and scales in every block (benchmarks' synthetic prefill; values don't matter
    to speed, but every code must decode to a finite number)."""
    for layer in pool.layers:
        for name, t in layer.items():
            if name in SUMMARY_TENSORS:
                continue  # the summaries: recomputed from the noise's keys afterwards
            if t.dtype == torch.float8_e4m3fn:
                t.copy_(torch.randn(t.shape, generator=g, device=t.device).to(t.dtype))
            elif t.dtype == torch.int32:
                t.random_(-(2**31), 2**31 - 1, generator=g)
            elif "scale" in name:
                t.uniform_(0.05, 0.15, generator=g)
            else:
                t.uniform_(-1.0, 0.0, generator=g)
