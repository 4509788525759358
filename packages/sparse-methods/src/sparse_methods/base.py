"""The SparseMethodRuntime contract: declarations, step contexts and lifecycle hooks.

A method is a class with a pydantic config (``Config``) and declarations: ``category``,
``prefill_policy``, ``prefix_cache_mode``, ``storage`` (the KV store it needs: kind and KV dtype),
``supports`` (MLA, sliding-window models, tensor parallelism) and a ``memory_plan``. Methods whose KV
heads keep different numbers of tokens (AdaKV, KVzip) declare the head-major store
(``StoreKind.HEAD_MAJOR``: a table per layer and KV head, ``Compaction.head_counts``), whose decode reads
every slot each head holds: they need no decode selection. RetroInfer declares the cluster-index store
(``StoreKind.CLUSTER_INDEX``): the engine sizes a ``ClusterArena`` from its memory plan's
``index_clusters`` and hands it over (``cluster_arena``); its index keeps value sums, so it observes
the layers' values too (``observes_values``). The engine drives it through eleven hooks
with plain tensors and small frozen records, never engine objects, so another engine can host the same
classes. Per step:

1. ``prepare_step(step)`` once before the forward, with every scheduled request's ``RequestStep``; it
   returns the requests whose attention inputs the step observes (the engine keeps that for the step).
2. per layer, ``layer_plan(layer)`` says how the layer involves the method (``LayerPlan``): how decode
   reads (everything; what ``select_decode`` picks for the whole batch on the device; everything after
   ``select_decode`` looked at the batch), whether prefill chunks read what ``prefill_selection`` picks,
   and which keys those need. ``select_decode`` may also give an attention state over keys its entries
   leave out (``DecodeSelection.extra``: e.g. RetroInfer's estimated clusters), which the engine merges
   into the decode's softmax (``sparse_kernels.merge_states``) after the kernel.
   ``selection_size`` gives the width of the device selections before the forward (static shapes).
   A method that reads recent decode queries back at its compactions, or sums decode attention scores,
   says so in ``device_state()`` (``DeviceState``, asked once when the engine is built); the engine then
   records the queries on the device (``query_ring``) instead of handing them over each step, or keeps
   running sums that the decode kernel's score output feeds (``decode_score_sums``).
3. after each full-attention layer's attention, once: ``on_attention_end(layer, batch)`` with every observed
   request (``LayerAttentionBatch``: each one's new queries and keys as a ``LayerAttention``, and, for
   decode rows over a plain paged store, the whole batch as tensors with its keys left in their pages);
   a method that declares ``observes_values`` gets the layer's values beside the keys. A method that
   reads only stored keys and values at a step (``observes_queries`` False, e.g. RetroInfer's index update,
   or an eviction round whose windows are all in the query ring) gets every layer's batch after the step's
   forward instead, read from the pool: its observing decode steps then replay their CUDA graph like any
   other.
4. ``finish_step()`` returns the compactions to apply (``Compaction``: kept slot indices per layer and
   KV head); the engine gathers the kept slots to the front of each layer and frees whole blocks that no
   layer uses any more.

Per request: ``replay_passes`` once its prompt is processed (extra forward passes over its KV, e.g.
KVzip's context reconstruction: the engine runs them as ordinary steps whose ``RequestStep.replay`` is
set, keeps none of their KV and samples nothing); ``release(request_id)`` when it finishes, is aborted
or is preempted, which returns the state the next turn of its chain needs (an opaque snapshot the engine
stores with the chain's retained KV). The request of the next turn (or each fork of the chain) brings that
state back on the first step it is scheduled in (``RequestStep.resumed_state``), which ``prepare_step``
takes over: the state reaches the method with the step that first needs it, through the hook that
already sees every request before its first forward.

Tensor parallelism (``Support.TENSOR_PARALLEL``): each rank runs its own instance over its shard of the
KV heads (``ModelShape``: the shard's KV heads and their whole query groups). Per-KV-head decisions
need nothing more. A decision that spans KV heads (one kept set shared by every head, a ranking of
all heads together) combines the shards first through ``SparseMethod.head_reduction``
(``HeadReduction``: sum, max, gather over the shards; the identity on one rank), which the engine
sets; its calls are collectives, so a method makes them only where every rank does (decisions that
depend on steps, lengths and configs, never on scores).

Slot order is the order of a request's table: slot ``i`` of layer ``l`` holds the ``i``-th
retained token of that layer (in arrival order). Keys are stored after RoPE with their original
positions, so compaction never re-rotates anything.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from sparse_methods.keep_rows import KeepRows

if TYPE_CHECKING:
    from sparse_methods.attention_batch import LayerAttentionBatch
    from sparse_methods.cluster_arena import ClusterArena
    from sparse_methods.decode_score_sums import DecodeScoreSums
    from sparse_methods.prefill_attention import PrefillAttention
    from sparse_methods.query_ring import QueryRing


class Category(enum.StrEnum):
    DENSE = "dense"
    PHYSICAL_EVICTION = "physical eviction"
    LOGICAL_MASKING = "logical masking"
    QUERY_AWARE_SELECTION = "query-aware selection"
    COMPRESSED_STORAGE = "compressed storage"


class PrefillPolicy(enum.StrEnum):
    ALL_CHUNKED = "all_chunked"
    """Prompts are prefilled in chunks under the step's token budget, batched with other work."""
    LONG_BS1FULL_SHORT_BATCH = "long_bs1full_short_batch"
    """A prompt longer than the chunk budget is prefilled alone in one pass (the method needs the
    whole prompt's attention at once); short prompts are batched as usual."""


class PrefixCacheMode(enum.StrEnum):
    RADIX = "radix"
    """KV stays token-exact: shared prefixes can be reused by content hash."""
    CHAIN = "chain"
    """KV was evicted: reuse only by resuming a conversation's chain (no radix sharing)."""


class StoreKind(enum.StrEnum):
    """What the KV store keeps beside the paged K/V (built by the engine, owned across steps)."""

    PAGED = "paged"
    PAGED_WITH_SUMMARIES = "paged + block summaries"
    """Per block (the page) and KV head, elementwise min and max of the keys (kept up to date on append)."""
    HEAD_MAJOR = "head-major paged"
    """A block table per (layer, KV head): a layer's heads may keep different numbers of tokens
    (``Compaction.head_counts``), and the memory in use is the sum of what each head keeps. The method's
    memory plan counts per-head averages. Decode reads every slot each head holds."""
    CLUSTER_INDEX = "paged + cluster index"
    """Per request and layer, a cluster index of the keys in fixed device buffers (``ClusterArena``: centroids,
    cluster sizes, token positions grouped by cluster), sized at build for the most running requests of the
    longest context (``MemoryPlan.index_clusters``) and handed to the method (``cluster_arena``), which fills it."""


@dataclass(frozen=True, slots=True)
class DeviceState:
    """Device buffers a method asks the engine to keep for it, beside the KV store (``SparseMethod.device_state``,
    asked once when the engine is built). The engine may decline either (a store whose kernels cannot feed
    it: quantized or latent); the method then observes through ``on_attention_end`` as usual.

    ``query_window``: the latest decode queries per (request, layer) the method reads back at its
    compactions (0: none). The engine may give it a ``QueryRing`` of that window (``SparseMethod.query_ring``)
    that every decode step writes on the device (full-attention layers, decode rows); the method then plans
    it in ``prepare_step`` and observes no request at the steps that only remember queries.

    ``score_sums``: ``(capacity, heads)`` of the running attention sums an accumulating method adds every
    decode query's probabilities to: the most slots a decoding request holds in a layer, and 1 (summed
    over the KV heads) or ``num_kv_heads`` (None: no sums). The engine may give it ``DecodeScoreSums``
    (``SparseMethod.decode_score_sums``) that the decode kernel's score output feeds inside the step.
    """

    query_window: int = 0
    score_sums: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.query_window < 0:
            raise ValueError(f"query_window must be >= 0, got {self.query_window}")
        if self.score_sums is not None and min(self.score_sums) < 1:
            raise ValueError(f"score_sums (capacity, heads) must be positive, got {self.score_sums}")


NO_DEVICE_STATE = DeviceState()
"""A method that keeps nothing on the device (the default)."""


@dataclass(frozen=True, slots=True)
class Storage:
    """The KV store a method needs (``SparseMethod.storage``): its kind and, for compressed-storage
    methods, the KV dtype it stores in (``fp8``, ``kivi``, ``turboquant``; None: the engine's
    ``kv_cache_dtype`` decides, the model dtype by default). Pages are always the engine's blocks.
    ``summary_dtype`` (``PAGED_WITH_SUMMARIES``): the block summaries' ``"model"`` dtype, or ``"int8"``
    codes with a scale per (block, KV head) (half the bytes; ``page_scale`` in ``DecodeBatch``);
    (``CLUSTER_INDEX``): the centroids', ``"int8"`` codes with a scale per (cluster, KV head) in the arena.
    ``page_tokens``: the block size the method's pages assume (None: any); the engine refuses another at
    start-up rather than at the first selection."""

    kind: StoreKind = StoreKind.PAGED
    kv_cache_dtype: str | None = None
    summary_dtype: str = "model"
    page_tokens: int | None = None


class Support(enum.StrEnum):
    """Model and engine shapes a method runs on besides plain full-attention, one rank (``SparseMethod.supports``)."""

    MLA = "mla"
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): the cache is one KV head of
    ``kv_lora_rank + rope`` channels (the latent store) seen through absorbed queries."""
    SLIDING_WINDOW = "sliding window"
    """Models with sliding-window layers (Gemma 3, Mistral / Qwen2 with a window): the engine attends
    densely over those layers' windows and never selects, observes or compacts them for the method; the
    method acts on the full-attention layers only (its memory plan and compactions leave windowed ones whole)."""
    TENSOR_PARALLEL = "tensor parallel"
    """The heads split over ranks: each rank's instance sees its KV heads and the query heads of their
    groups (``ModelShape``; the engine gathers a replicated KV head's group), so what it selects or evicts
    per KV head is the same on every rank that holds that head. A decision that spans KV heads needs a
    reduction over ranks first (``SparseMethod.head_reduction``)."""


class DecodeRead(enum.StrEnum):
    """How a layer's decode queries read the KV (``LayerPlan.decode``)."""

    ALL = "all"
    """Every slot, no selection."""
    SELECTED = "selected"
    """What ``select_decode`` picks for the whole batch on the device (no host sync: CUDA-graph safe)."""
    OBSERVED = "observed"
    """Every slot, after ``select_decode`` looked at the batch on the device (it returns None; e.g. a
    filter layer that picks what the next layers read)."""


class Unit(enum.StrEnum):
    """What one entry of a decode selection reads (``LayerPlan.unit``)."""

    PAGE = "page"
    """A page: the engine's block of ``block_size`` slots."""
    SLOT = "slot"
    """One slot."""


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """How one layer involves the method in a step (``SparseMethod.layer_plan``).

    ``decode``: how decode queries read (``DecodeRead``). ``decode_keys``: decode selection needs the
    layer's keys (``DecodeBatch.key_cache``). ``prefill``: prefill chunks read the history
    ``prefill_selection`` picks (else all of it); ``prefill_keys``: it needs the history's keys
    (``PrefillView.keys``). ``unit``: the entries of decode selections (pages or slots).
    """

    decode: DecodeRead = DecodeRead.ALL
    decode_keys: bool = False
    prefill: bool = False
    prefill_keys: bool = False
    unit: Unit = Unit.PAGE

    def __post_init__(self) -> None:
        if self.decode_keys and self.decode is DecodeRead.ALL:
            raise ValueError("decode_keys needs a selecting decode")
        if self.prefill_keys and not self.prefill:
            raise ValueError("prefill_keys needs a selecting prefill")

    @property
    def selects_decode(self) -> bool:
        """Decode goes through ``select_decode`` (``SELECTED`` or ``OBSERVED``)."""
        return self.decode is not DecodeRead.ALL

    def unit_slots(self, block_size: int) -> int:
        """Slots per selection entry."""
        return block_size if self.unit is Unit.PAGE else 1


DENSE_LAYER = LayerPlan()
"""The plan of a layer the method leaves alone (the default)."""


class MethodConfig(BaseModel):
    """Base of every method's config: validated, frozen, unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a method needs to know about the model."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    windowed_layers: frozenset[int] = frozenset()
    """Layers whose attention slides over a window (Gemma 3's local layers, Mistral's): the engine
    attends densely over their windows and never hands them to a method (``Support.SLIDING_WINDOW``)."""

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"model shape must be positive: {self}")
        if any(not 0 <= layer < self.num_layers for layer in self.windowed_layers):
            raise ValueError(f"windowed layers outside 0 .. {self.num_layers - 1}: {sorted(self.windowed_layers)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


class HeadReduction:
    """Combines what a method computed over its shard of the KV heads with the other shards' results.

    The model's KV heads are split into ``num_shards`` equal shards of ``ModelShape.num_kv_heads``
    heads, in head order (ranks that share a replicated KV head hold the same shard; it counts once).
    Every operation returns the same tensor on every rank, and every rank must call it at the same
    point (they are collectives). This base class is one shard holding every head: each operation is
    the identity. The engine hands a method its rank's reduction (``SparseMethod.head_reduction``).
    """

    num_shards: int = 1

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the shards (each shard's ``x`` of the same shape)."""
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over the shards."""
        return x

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every shard's ``x`` concatenated along ``dim`` in head order (``dim`` indexes this shard's heads)."""
        return x

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This shard's part of a ``gather``-ed ``x`` along ``dim``."""
        return x

    def num_kv_heads(self, shape: ModelShape) -> int:
        """The model's KV heads, of which ``shape`` is one shard."""
        return shape.num_kv_heads * self.num_shards


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """KV tokens (slots) a request holds in each layer, from its method's point of view.

    ``prefill_peak_tokens[l]``: the most layer ``l`` holds while the prompt is processed.
    ``resident_tokens[l]``: what it holds once the prompt is processed (after any compression).
    ``decode_peak_tokens[l]``: the most it holds while generating (the steady state that decides
    how many requests fit). ``index_clusters``: a ``StoreKind.CLUSTER_INDEX`` method's bound on the
    clusters its index of a layer holds for the request (its tokens are bounded by ``peak_tokens``).
    """

    prefill_peak_tokens: tuple[int, ...]
    resident_tokens: tuple[int, ...]
    decode_peak_tokens: tuple[int, ...]
    index_clusters: int = 0

    @property
    def peak_tokens(self) -> tuple[int, ...]:
        return tuple(max(a, b) for a, b in zip(self.prefill_peak_tokens, self.decode_peak_tokens, strict=True))

    @classmethod
    def uniform(
        cls, num_layers: int, prefill_peak: int, resident: int, decode_peak: int, index_clusters: int = 0
    ) -> MemoryPlan:
        return cls((prefill_peak,) * num_layers, (resident,) * num_layers, (decode_peak,) * num_layers, index_clusters)


@dataclass(frozen=True, slots=True)
class RequestStep:
    """One request's part of a step.

    ``start`` is the logical position of the first new token (tokens before it are processed),
    ``num_new_tokens`` how many this step adds, ``prompt_len`` the prompt's length and
    ``kv_lens[l]`` the slots layer ``l`` holds before this step.
    """

    request_id: Hashable
    start: int
    num_new_tokens: int
    prompt_len: int
    kv_lens: tuple[int, ...]
    replay: int | None = None
    """Index of the method's replay pass (``replay_passes``) this step runs for the request, or None:
    the step processes the request's own tokens."""
    resumed_state: object | None = None
    """Set on the first step of a request that resumed a chain: the state ``release`` returned when the
    chain's last turn ended (its KV is the chain's retained KV; ``kv_lens`` count it), for ``prepare_step``
    to take over. The same state may come back more than once (forks of a chain): the method copies what
    it will mutate. None on every other step."""

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        return self.start >= self.prompt_len and self.replay is None

    @property
    def ends_prefill(self) -> bool:
        """This step processes the prompt's last token."""
        return self.start < self.prompt_len <= self.end


@dataclass(frozen=True, slots=True)
class ReplayPass:
    """An extra forward pass a method asks for once a request's prompt is processed (``replay_passes``).

    ``parts``: text (tokenized by the engine, without special tokens) and token-id tuples, joined in
    order. The engine runs the tokens as one chunk at the positions after the request's processed
    tokens, attending to the request's KV and causally to themselves; their K/V are dropped after the
    pass and nothing is sampled. The method observes the pass like any step (``prepare_step``,
    ``on_attention_end``, its ``RequestStep.replay`` set) and may compact in ``finish_step``.
    """

    parts: tuple[str | tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class StepContext:
    requests: tuple[RequestStep, ...]


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What a method may read after one layer's attention, for one request (``LayerAttentionBatch.request``).

    ``queries``: ``[num_new_tokens, num_q_heads, head_dim]``, the step's queries (after RoPE).
    ``keys``: ``[kv_len, num_kv_heads, head_dim]``, every slot the layer holds for the request after
    this step's keys were stored, in slot order (the last ``num_new_tokens`` are the new ones).
    ``scale``: the softmax scale attention used. ``values``: like ``keys``, the layer's values, when the
    method observes them (``SparseMethod.observes_values``); None otherwise.

    ``head_lens``: None, or (a ``StoreKind.HEAD_MAJOR`` layer whose KV heads hold different numbers of
    slots, e.g. a resumed chain compacted per head) per KV head the slots it holds after this step:
    head ``h``'s slots are ``keys[: head_lens[h] - n, h]`` then the step's ``n`` tokens ``keys[-n:, h]``
    (rows between are padding, not slots), and a ``Compaction`` row ``h`` indexes them in that order.
    ``head_keys(h)`` gives them.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    scale: float
    head_lens: tuple[int, ...] | None = None
    values: torch.Tensor | None = None

    def head_keys(self, head: int) -> torch.Tensor:
        """``[head_lens[head], D]`` the slots KV head ``head`` holds, in slot order."""
        keys, n = self.keys[:, head], self.queries.shape[0]
        if self.head_lens is None:
            return keys
        return torch.cat([keys[: self.head_lens[head] - n], keys[keys.shape[0] - n :]])


@dataclass(frozen=True, slots=True)
class PrefillView:
    """What a method sees to choose which history a prefill chunk reads, in one layer.

    ``queries``: ``[num_new_tokens, num_q_heads, head_dim]`` (after RoPE); ``history_len``: slots
    the request held before this chunk; ``keys``: ``[history_len, num_kv_heads, head_dim]`` the
    layer's history keys in slot order when the method asked for them (``LayerPlan.prefill_keys``).
    """

    queries: torch.Tensor
    history_len: int
    keys: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Selection:
    """What one prefill chunk reads of its history: ``indices`` ``[num_kv_heads, n]`` ascending, in units of
    ``page_size`` slots of the request's table (``page_size=1``: single tokens)."""

    indices: torch.Tensor
    page_size: int


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """A batch of decode queries, on the device, for selection without host sync (the batched path).

    Every tensor lives on the device and every shape is fixed by host values known at plan time, so
    a hook given one can run inside a CUDA graph (no ``.item()``, no data-dependent shapes).

    ``query``: ``[B, num_q_heads, head_dim]``. ``kv_lens``: int64 ``[B]``, slots each row holds in
    this layer (its newest included). ``table_indices`` / ``table_start``: row ``b``'s blocks in table
    order are ``table_indices[table_start[b] : table_start[b] + ceil(kv_lens[b] / block_size)]``
    (``table_start`` int64 ``[B]``). ``max_pages``: no row holds more blocks (a static width for
    per-page or per-token outputs). ``page_min`` / ``page_max``: the pool's block summaries
    ``[num_blocks, num_kv_heads, head_dim]`` when the store keeps them; int8 codes standing for
    ``page_scale[..., None] * page_min`` (and ``page_max``) when ``page_scale`` (float32
    ``[num_blocks, num_kv_heads]``) is given (``Storage.summary_dtype`` int8). ``page_levels`` > 0: the
    store keeps no summaries of its own but its pages' key statistics bound them (KIVI): ``page_min`` is
    each full page's per-channel key minimum and ``page_max`` its step, the page's keys lying in
    ``[page_min, page_min + page_levels * page_max]``; a row's incomplete last page has none (a selection
    from them keeps the newest page anyway). ``key_cache``: the layer's
    keys ``[num_blocks, block_size, num_kv_heads, head_dim]`` when the method asked for them
    (``LayerPlan.decode_keys``). ``sm_scale``: the attention's softmax scale. ``page_counts``: int64
    ``[B]`` pages each row holds (``ceil(kv_lens / block_size)``) when the caller has them already
    (saves two launches per layer); ``num_pages`` computes them otherwise.

    At an ``OBSERVED`` layer (``DecodeRead``) the engine may have computed the
    layer's raw logits already, because it attends from them: ``logits`` float32 ``[B, num_q_heads,
    max_pages * block_size]``, ``sm_scale * q . k`` of every row's tokens in table order (columns past a
    row unspecified), with ``logit_lse`` float32 ``[B, num_q_heads]``, each head's log-sum-exp over the row's
    tokens, so that a token's probability under head ``h`` is ``exp(logits - logit_lse)``. None when not
    computed.
    """

    query: torch.Tensor
    kv_lens: torch.Tensor
    table_indices: torch.Tensor
    table_start: torch.Tensor
    max_pages: int
    block_size: int
    page_min: torch.Tensor | None = None
    page_max: torch.Tensor | None = None
    page_scale: torch.Tensor | None = None
    page_levels: int = 0
    key_cache: torch.Tensor | None = None
    sm_scale: float = 1.0
    page_counts: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logit_lse: torch.Tensor | None = None

    @property
    def num_pages(self) -> torch.Tensor:
        if self.page_counts is not None:
            return self.page_counts
        return (self.kv_lens + self.block_size - 1) // self.block_size


@dataclass(frozen=True, slots=True)
class AttentionState:
    """Decode queries' attention over a set of keys, as a state that merges with another set's:
    ``out`` float32 ``[B, num_q_heads, head_dim]``, the softmax-normalised output, and ``lse`` float32
    ``[B, num_q_heads]``, the natural log of the softmax denominator (``-inf`` with ``out = 0``: the set
    is empty for that row and head). A set may be weighted (RetroInfer's estimated clusters count each
    centroid ``size`` times): only ``out`` and ``lse`` matter. A state may also come as ``S`` partial states
    over disjoint parts of the set, ``out`` ``[B, num_q_heads, S, head_dim]`` and ``lse`` ``[B, num_q_heads,
    S]`` (a split kernel's, left unmerged): the engine merges them with the rest in the decode's own reduce."""

    out: torch.Tensor
    lse: torch.Tensor

    @property
    def partial(self) -> bool:
        """Whether the state comes as partial states (a split axis before ``head_dim``)."""
        return self.out.dim() == 4

    def merged(self) -> AttentionState:
        """The one state (``sparse_kernels.merge_states.reduce_states`` of partial ones; itself otherwise)."""
        if not self.partial:
            return self
        from sparse_kernels.merge_states import reduce_states

        return AttentionState(*reduce_states(self.out, self.lse))


@dataclass(frozen=True, slots=True)
class DecodeSelection:
    """``select_decode``'s answer when the decode reads more than its entries.

    ``entries``: as a plain answer, ``[B, num_kv_heads, size]`` entry indices. ``extra``: an
    ``AttentionState`` over keys the entries do not read (disjoint from them), made on the device from
    the same batch, which the engine merges into the softmax over the entries' tokens after the decode
    kernel, so each query head attends once over both; None: the entries alone. Its rows are the
    batch's rows, its query heads those of ``DecodeBatch.query``."""

    entries: torch.Tensor
    extra: AttentionState | None = None


@dataclass(frozen=True, slots=True)
class Compaction:
    """Kept slots of one request: ``keep[l]`` is None (layer unchanged) or ``[num_kv_heads, n_l]``
    int64 indices into the layer's current slots, ascending in each row.

    ``head_counts`` (a ``StoreKind.HEAD_MAJOR`` store only; empty: none): per layer, None or per KV head
    how many leading entries of its ``keep`` row it keeps (ragged per-head budgets); the rest of the row
    is padding, never read. ``counts(l)`` gives every layer's.

    ``rows`` (empty: none): per layer, None or the batched round's tensor whose row ``keep[l]`` is
    (``KeepRows``), which lets the engine compact a layer's requests of one round together."""

    keep: tuple[torch.Tensor | None, ...]
    head_counts: tuple[tuple[int, ...] | None, ...] = ()
    rows: tuple[KeepRows | None, ...] = ()

    def counts(self, layer: int) -> tuple[int, ...] | None:
        """Per KV head, the slots layer ``layer`` keeps (None: the layer is unchanged)."""
        keep = self.keep[layer]
        if keep is None:
            return None
        ragged = self.head_counts[layer] if self.head_counts else None
        return ragged if ragged is not None else (keep.shape[1],) * keep.shape[0]


class SparseMethod(ABC):
    """Base of all methods. Subclasses set the class attributes and implement the hooks they need."""

    name: ClassVar[str]
    category: ClassVar[Category]
    Config: ClassVar[type[MethodConfig]]
    prefill_policy: ClassVar[PrefillPolicy] = PrefillPolicy.ALL_CHUNKED
    prefix_cache_mode: ClassVar[PrefixCacheMode]
    storage: Storage = Storage()
    """The KV store the method needs (kind and KV dtype). The engine reads the class's before it builds the
    method (the KV dtype it implies), the instance's for the store; a method may refine it per instance
    from its config in ``__init__`` (the summaries' dtype), never its kind or KV dtype."""
    supports: ClassVar[frozenset[Support]] = frozenset()
    """Model and engine shapes the method runs on besides plain full attention on one rank (``Support``)."""
    head_reduction: HeadReduction = HeadReduction()
    """Combines per-shard results over the tensor-parallel ranks (set by the engine; the identity on one
    rank): see ``HeadReduction`` and the module docstring."""
    prefill_attention: PrefillAttention | None = None
    """How prefill chunks attend when a prefill attention method is chosen (``build_method`` sets it);
    None: dense prefill attention."""
    query_ring: QueryRing | None = None
    """Set by the engine when ``device_state().query_window`` is positive and its store keeps plain queries."""
    decode_score_sums: DecodeScoreSums | None = None
    """Set by the engine when ``device_state().score_sums`` is given and the decode kernel can write scores."""
    cluster_arena: ClusterArena | None = None
    """Set by the engine for a ``StoreKind.CLUSTER_INDEX`` store (see there)."""
    observes_values: bool = False
    """The views ``on_attention_end`` gets carry the layer's values beside its keys (``LayerAttention.values``,
    ``PagedKeys.v_cache``) where the store keeps them plainly (a paged store with a table per request, as the
    query-aware methods' are; elsewhere None); a method may set it per instance (from its config) in
    ``__init__``."""
    observes_queries: ClassVar[bool] = True
    """``on_attention_end`` reads the observed requests' queries. False: it reads only their stored keys (and
    values), so the engine may hand each layer's batch over after the step's forward, from the pool (a decode
    step that observes then still replays its CUDA graph); the queries it gets then have no heads
    (``[num_new_tokens, 0, head_dim]``). The engine reads it after ``prepare_step``, so a method may answer per
    step (a property): the eviction family's decode rounds read their windows from the query ring."""

    def __init__(self, config: MethodConfig, shape: ModelShape):
        if not isinstance(config, self.Config):
            raise TypeError(f"{self.name} needs a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config
        self.shape = shape

    # -- declarations ------------------------------------------------------------------------
    @abstractmethod
    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        """KV tokens per layer for a request of ``prompt_len`` + ``max_new_tokens`` tokens whose prompt
        is prefilled in chunks of at most ``chunk_size`` tokens."""

    def layer_plan(self, layer: int) -> LayerPlan:
        """How ``layer``'s attention involves the method this step (asked after ``prepare_step``; it may
        change between steps, never within one)."""
        return DENSE_LAYER

    def device_state(self) -> DeviceState:
        """The device buffers the method wants the engine to keep for it (``DeviceState``: a ring of recent
        decode queries, running decode-score sums), asked once when the engine is built, after it set
        ``head_reduction``."""
        return NO_DEVICE_STATE

    # -- one step ------------------------------------------------------------------------------
    def prepare_step(self, step: StepContext) -> Collection[Hashable]:
        """Called once per step before the forward; returns the requests whose attention inputs every
        full-attention layer hands to ``on_attention_end`` this step (empty: the step observes nothing).
        A request that resumed a chain brings its state on its first step (``RequestStep.resumed_state``)."""
        return frozenset()

    def on_attention_end(self, layer: int, batch: LayerAttentionBatch) -> None:  # noqa: B027
        """Observe the step's observed requests' queries and keys after ``layer``'s attention, all at once
        (``batch.request(i)``: request ``i``'s ``LayerAttention``; ``batch.keys``: the batch's paged keys)."""

    def selection_size(self, kv_len: int, page_size: int) -> int | None:
        """Entries of ``page_size`` slots (``LayerPlan.unit``) that a selecting layer reads per KV head for
        a context of ``kv_len``, or None when the query reads everything (the width of ``select_decode``'s
        answer for that row)."""
        return None

    def select_decode(self, layer: int, batch: DecodeBatch) -> torch.Tensor | DecodeSelection | None:
        """A ``SELECTED`` layer: ``[B, num_kv_heads, size]`` distinct entry indices (``LayerPlan.unit``, in
        table order, the newest last; ascending or in any other order: the decode's softmax does not depend
        on it) for a batch whose rows select ``size`` (the largest of their
        ``selection_size``) entries, made on the device without host sync; a row that selects fewer has
        its own number read (the rest is ignored); entries past a row's length (padding rows of a CUDA
        graph) are allowed and read the row's last entry. Or a ``DecodeSelection``: those entries plus an
        attention state over keys they leave out, which the engine merges into the decode (fixed shapes,
        no host sync, like the entries). An ``OBSERVED`` layer: look at the batch and return None (every
        slot is read)."""
        raise NotImplementedError(f"{self.name} has no device selection")

    def prefill_selection(self, layer: int, request: RequestStep, view: PrefillView) -> Selection | None:
        """A layer whose plan has ``prefill``: history slots (``page_size=1``, ``[num_kv_heads, n]``
        ascending) a prefill chunk reads besides its own tokens (causally), or None to read the whole
        history."""
        return None

    def finish_step(self) -> Mapping[Hashable, Compaction]:
        """Evictions decided this step, by request id (applied before the next step)."""
        return {}

    # -- request events --------------------------------------------------------------------------
    def replay_passes(self, request_id: Hashable, prompt_token_ids: Sequence[int]) -> tuple[ReplayPass, ...]:
        """Extra passes to run for a request once its prompt is processed, in order, before its first
        decode (asked once per prefill; its first output token is sampled from the prompt as usual)."""
        return ()

    def release(self, request_id: Hashable) -> object | None:
        """Forget a request (finished, aborted or preempted); returns its state that the next turn of its
        chain needs (None: nothing), which the engine keeps when a finished turn closes a chain and hands
        back on that turn's first step (``RequestStep.resumed_state``)."""
        return None

    # -- derived, not hooks ----------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """What this method's KV depends on besides tokens (goes into cache salts)."""
        prefill = {} if self.prefill_attention is None else {"prefill": self.prefill_attention.fingerprint()}
        return {"sparse_method": self.name, **self.config.model_dump(), **prefill}

    def decode_read_tokens(self, layer: int, kv_len: int, block_size: int) -> int:
        """Tokens (per KV head) a decode query of a ``kv_len`` context reads in ``layer`` (reports)."""
        plan = self.layer_plan(layer)
        if plan.decode in (DecodeRead.ALL, DecodeRead.OBSERVED):
            return kv_len
        unit = plan.unit_slots(block_size)
        size = self.selection_size(kv_len, unit)
        return kv_len if size is None else min(kv_len, size * unit)
