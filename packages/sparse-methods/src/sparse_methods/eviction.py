"""The eviction family's base: a method is a config, per-layer budgets and a ``score()``.

A subclass says how many tokens each layer keeps (``budgets``), which tokens are protected (sink and
recent, ``protected``) and how the others rank (``score``: per-token, per-KV-head scores, higher =
keep). Everything else lives here once:

- which requests' attention inputs each step needs (what ``prepare_step`` returns), derived from when the
  method compacts and how many recent queries it observes (``observation_window``);
- the observed queries of each (request, layer): a sliding window of the latest ones, or, for an
  accumulating scorer (``accumulates``, H2O), a running per-token score that follows its tokens;
  with decode-time eviction, decode steps that do not compact write their queries into the engine's
  ``QueryRing`` on the device and observe nothing (so they replay CUDA graphs); the compacting step
  folds the ring into the window;
- top-k under the budget with sink / recent protection, per KV head or shared by all heads (a
  score with one row), and the ``Compaction`` records ``finish_step`` hands the engine;
  a layer's compacting requests are scored and ranked together once its last one was observed
  (``DeferredSelections``: ``score_batch`` and one top-k per budget), so a decode-time eviction of
  the whole batch costs a few device ops per layer rather than per (request, layer); decode rows that the
  engine hands over as tensors, with their windows in the query ring, take ``BatchedRound`` (no
  per-request views at all);
- decode-time eviction every ``decode_eviction_interval`` generated tokens, counted over a chain;
- the memory plan (peaks and resident tokens per layer follow from the budgets and the schedule);
- chain state (``release`` returns it, a resumed request's first step brings it back: ``RequestStep.resumed_state``);
- sliding-window layers (``ModelShape.windowed_layers``): never compacted (the engine observes none), their
  budget unbounded, so a windowed model's local layers keep their window and the method acts on its global ones.

A method that ranks nothing (``observation_window`` None, StreamingLLM) asks for no attention
inputs at all, so its decode steps stay eligible for CUDA graphs.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import (
    NO_DEVICE_STATE,
    Category,
    Compaction,
    DeviceState,
    LayerAttention,
    MemoryPlan,
    MethodConfig,
    ModelShape,
    PrefixCacheMode,
    RequestStep,
    SparseMethod,
    StepContext,
    Support,
)
from sparse_methods.deferred_selections import DeferredSelections, ScoreBatch
from sparse_methods.eviction_device import DeviceObservation
from sparse_methods.eviction_round import BatchedRound
from sparse_methods.keep_rows import KeepRows
from sparse_methods.keep_selection import keep_indices, keep_indices_batch
from sparse_methods.scoring import MAX_SCORE_ELEMENTS

_UNBOUNDED = sys.maxsize  # the budget of a layer the method leaves alone (a sliding-window layer)


class Phase(enum.StrEnum):
    """When a compaction can happen."""

    CHUNK = "chunk"
    """After a prefill chunk that does not end the prompt (bounds a long prompt's peak)."""
    PROMPT = "prompt"
    """After the chunk that ends the prompt."""
    DECODE = "decode"
    """Every ``decode_eviction_interval`` generated tokens."""


@dataclass(frozen=True, slots=True)
class ScoreInputs:
    """What ``score()`` sees for one request in one layer.

    ``queries``: ``[n, num_q_heads, head_dim]`` observed queries (after RoPE), the tokens of the last
    ``n`` slots: the latest ``observation_window`` observed ones, or for an accumulating scorer the
    ones this step observed. ``keys``: ``[kv_len, num_kv_heads, head_dim]`` every slot the layer holds,
    in slot order (this step's keys last). ``scale``: the attention's softmax scale.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    scale: float

    @property
    def query_slots(self) -> torch.Tensor:
        """``[n]`` slot of each query (the last ``n`` slots)."""
        kv_len = self.keys.shape[0]
        return torch.arange(kv_len - self.queries.shape[0], kv_len, device=self.keys.device)


@dataclass(slots=True)
class _RequestState:
    """Per request, what survives across steps (and a chain's turns): decode tokens counted for the
    interval, per layer the observed query window or the running scores. The window only ever holds
    the queries of the latest slots: a step that brings tokens it does not observe (a resumed turn's
    unobserved prompt, say) empties it first."""

    decoded: int = 0
    window: list[torch.Tensor | None] = field(default_factory=list)
    scores: list[torch.Tensor | None] = field(default_factory=list)


class EvictionMethod(DeviceObservation, BatchedRound, SparseMethod):
    """Base of the physical-eviction family (KV of dropped tokens is freed, positions unchanged).

    Subclasses set ``name`` and ``Config`` (with a ``decode_eviction_interval`` field, 0: never) and implement
    ``budgets`` and, unless ``observation_window`` is None, ``score``.
    """

    category = Category.PHYSICAL_EVICTION
    prefix_cache_mode = PrefixCacheMode.CHAIN
    supports = frozenset({Support.SLIDING_WINDOW})  # compacts the full-attention layers only (``_layer_budgets``)
    batches_compactions: ClassVar[bool] = True
    """A window scorer's compactions of one layer are scored and selected together (``score_batch`` and one
    top-k per budget, when the layer's last request was observed); False: each alone (``_select``)."""
    accumulates: ClassVar[bool] = False
    """``score()`` is called for every step that observes queries and the results add up per token
    (H2O; ``score()`` then returns a new tensor, which the base adds the earlier sums into);
    otherwise it is called only when compacting, with the latest observed queries."""
    evicts_by_length: ClassVar[bool] = False
    """When a decode step compacts: every ``_interval`` generated tokens, counted over a chain (False), or
    after a step that leaves a layer holding at least its budget plus ``_interval`` slots, that layer
    alone (True: SkipKV's trigger, so a prompt longer than the budget compacts at its first decode)."""

    def __init__(self, config: MethodConfig, shape: ModelShape) -> None:
        super().__init__(config, shape)
        self._states: dict[Hashable, _RequestState] = {}
        self._step: dict[Hashable, tuple[tuple[int, ...] | None, int]] = {}  # request -> (budgets, rows)
        self._observing: frozenset[Hashable] = frozenset()
        self._pending: dict[Hashable, list[torch.Tensor | None]] = {}
        self._round_rows: dict[tuple[Hashable, int], tuple[torch.Tensor, KeepRows]] = {}  # batched rounds' rows
        self._deferred = DeferredSelections()

    # -- what a method says ----------------------------------------------------------------------
    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        """Tokens each layer keeps when compacting at ``phase`` for a request whose prompt has
        ``prompt_len`` tokens, or None: the method does not compact at that phase."""
        raise NotImplementedError

    def protected(self, budget: int) -> tuple[int, int]:
        """``(sink, recent)`` tokens of a ``budget`` always kept (the rest ranks by score): the config's
        ``sink_keep_tokens`` and ``recent_keep_tokens``, cut to the budget."""
        sink = min(getattr(self.config, "sink_keep_tokens", 0), budget)
        return sink, min(getattr(self.config, "recent_keep_tokens", 0), budget - sink)

    @property
    def observation_window(self) -> int | None:
        """Latest prompt queries (of the prompt, or of each compacted chunk) that ``score()`` observes;
        0: every prompt query; None: the method ranks nothing and asks for no attention inputs."""
        return None

    def score(self, layer: int, inputs: ScoreInputs) -> torch.Tensor:
        """``[num_kv_heads, M]`` (per-head selection) or ``[1, M]`` (one choice for every head) scores
        of slots ``0 .. M-1``, higher = keep, with ``M`` at least the slots before the recent ones."""
        raise NotImplementedError(f"{self.name} ranks no tokens")

    def _layer_budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        """``budgets`` with the sliding-window layers unbounded: they keep every slot (their window
        is applied by attention over slots that are positions, which a compaction would break)."""
        budgets = self.budgets(prompt_len, phase)
        windowed = self.shape.windowed_layers
        if budgets is None or not windowed:
            return budgets
        if len(windowed) == self.shape.num_layers:
            return None  # nothing to compact
        return tuple(_UNBOUNDED if layer in windowed else b for layer, b in enumerate(budgets))

    # -- derived: the memory plan --------------------------------------------------------------------
    @property
    def _interval(self) -> int | None:
        """Generated tokens between decode-time evictions; None: never (``decode_eviction_interval`` 0)."""
        return getattr(self.config, "decode_eviction_interval", 0) or None

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        chunk = self._layer_budgets(prompt_len, Phase.CHUNK)
        prompt = self._layer_budgets(prompt_len, Phase.PROMPT)
        decode = self._layer_budgets(prompt_len, Phase.DECODE) if self._interval is not None else None
        prefill_peak, resident, decode_peak = [], [], []
        for layer in range(self.shape.num_layers):
            prefill_peak.append(prompt_len if chunk is None else min(prompt_len, chunk[layer] + chunk_size))
            kept = prefill_peak[-1] if prompt is None else min(prompt_len, prompt[layer])  # None: no compaction
            resident.append(kept)
            grown = kept + max_new_tokens
            decode_peak.append(grown if decode is None else min(grown, max(kept, decode[layer]) + self._interval))
        return MemoryPlan(tuple(prefill_peak), tuple(resident), tuple(decode_peak))

    # -- derived: the step's schedule ----------------------------------------------------------------
    def prepare_step(self, step: StepContext) -> frozenset[Hashable]:
        self._step, self._pending, self._round_rows = {}, {}, {}
        for r in step.requests:
            if r.request_id not in self._states:
                self._states[r.request_id] = self._resumed(r.resumed_state)
        recorded = self._plan_device(step.requests)
        for r in step.requests:
            state = self._states[r.request_id]
            budgets = self._compaction(r, state)
            rows = self._observed_rows(r, budgets, r.request_id in recorded)
            if rows < r.num_new_tokens and r.request_id not in recorded:
                self._forget_window(r.request_id, state)
            self._step[r.request_id] = (budgets, rows)
            if budgets is not None and self.observation_window is None:
                self._compact_by_position(r, budgets)
        self._observing = frozenset(rid for rid, (_, rows) in self._step.items() if rows)
        return self._observing

    @property
    def observes_queries(self) -> bool:  # type: ignore[override]  # per step (after ``prepare_step``)
        """False at a step whose every observed request is a decode row whose query the device keeps (the query
        ring's window, or the decode kernel's score sums, this step's included): its observation reads no query
        from the forward, so the step can replay its CUDA graph and be observed after, from the pool."""
        return not self._observing <= self._recorded

    def device_state(self) -> DeviceState:
        """With decode-time eviction, a window scorer remembers its decode queries in the ring and an
        accumulating scorer adds the decode kernel's scores on the device."""
        if self._interval is None:
            return NO_DEVICE_STATE
        if not self.accumulates:
            return DeviceState(query_window=self.observation_window or 0)
        return DeviceState(score_sums=self._score_sums_shape())

    def _score_sums_shape(self) -> tuple[int, int] | None:
        """``(capacity, heads)`` of the running sums: a request holds at most its largest budget plus an
        interval while decoding (and one more token: a resumed turn's first)."""
        heads = self.score_heads
        if heads == 1 and self.head_reduction.num_shards > 1:
            return None  # (a sum over every shard's heads would need a collective per step and layer)
        budgets = [self._layer_budgets(1, phase) for phase in (Phase.PROMPT, Phase.DECODE)]
        bounded = [b for layers in budgets if layers is not None for b in layers if b != _UNBOUNDED]
        return (max(bounded) + self._interval + 1, heads) if bounded else None

    @property
    def score_heads(self) -> int:
        """Rows of ``score()``: ``num_kv_heads`` (per-head selection) or 1 (one choice for every head)."""
        return self.shape.num_kv_heads

    def _layers(self) -> list[torch.Tensor | None]:
        return [None] * self.shape.num_layers

    def _compaction(self, r: RequestStep, state: _RequestState) -> tuple[int, ...] | None:
        """Per-layer budgets if this step ends in a compaction of ``r`` (layers within budget stay)."""
        if r.is_decode:
            interval = self._interval
            before, state.decoded = state.decoded, state.decoded + r.num_new_tokens
            if interval is None:
                return None
            if self.evicts_by_length:
                return self._layers_over(r, interval)
            if before // interval == state.decoded // interval:
                return None
            return self._layer_budgets(r.prompt_len, Phase.DECODE)
        return self._layer_budgets(r.prompt_len, Phase.PROMPT if r.ends_prefill else Phase.CHUNK)

    def _layers_over(self, r: RequestStep, interval: int) -> tuple[int, ...] | None:
        """Decode budgets of the layers that hold at least their budget plus ``interval`` slots after the
        step (the others unbounded); None when no layer does."""
        budgets = self._layer_budgets(r.prompt_len, Phase.DECODE)
        if budgets is None:
            return None
        due = tuple(
            b if b != _UNBOUNDED and n + r.num_new_tokens >= b + interval else _UNBOUNDED
            for b, n in zip(budgets, r.kv_lens, strict=True)
        )
        return None if all(b == _UNBOUNDED for b in due) else due

    def _observed_rows(self, r: RequestStep, budgets: tuple[int, ...] | None, recorded: bool) -> int:
        """How many of the step's last queries ``r`` hands to the method (0: none). ``recorded``: the ring
        keeps its decode query, which only a compacting step needs to hand over."""
        w = self.observation_window
        if w is None:
            return 0
        if r.is_decode:
            if recorded:  # kept on the device: handed over only to compact
                return r.num_new_tokens if budgets is not None else 0
            return r.num_new_tokens if self._interval is not None else 0
        if self._layer_budgets(r.prompt_len, Phase.CHUNK) is not None:  # every chunk compacts: its own last rows
            return r.num_new_tokens if w == 0 else min(w, r.num_new_tokens)
        prompt = self._layer_budgets(r.prompt_len, Phase.PROMPT)
        if prompt is None or r.prompt_len <= min(prompt):
            return 0  # the prompt is not compacted or fits every layer: nothing will be ranked
        first = r.start if w == 0 else max(r.start, r.prompt_len - w)
        return max(0, r.end - first)

    # -- derived: observing and compacting ---------------------------------------------------------
    def on_attention_end(self, layer: int, batch: LayerAttentionBatch) -> None:
        rest = self._observe_batched(layer, batch) if self._batches_ring(batch) else range(len(batch))
        for i in rest:
            self._observe_request(layer, batch.requests[i], batch.request(i))
        self._flush()

    def _observe_request(self, layer: int, request: RequestStep, view: LayerAttention) -> None:
        """One request's observation (the reference of the batched path): fold its queries into its
        window (or add its scores), and select now or defer to the layer's ``_flush``."""
        rid = request.request_id
        budgets, rows = self._step[rid]
        state = self._states[rid]
        queries, kv_len = view.queries[-rows:], view.keys.shape[0]
        summed = self.decode_score_sums is not None and rid in self._recorded
        if summed:  # the decode kernel's scores were added on the device, this step's included
            scores = self.decode_score_sums.row(rid, layer)
        elif self.accumulates:
            scores = self.score(layer, ScoreInputs(queries, view.keys, view.scale))
            prev = state.scores[layer]
            if prev is not None:
                scores[:, : prev.shape[1]] += prev
            state.scores[layer] = scores
        else:
            prev = state.window[layer]
            if self.query_ring is not None:  # queries the ring kept since the last fold (this step's, if recorded)
                ring = self.query_ring.latest(rid, layer)
                queries = ring if rid in self._recorded else torch.cat([ring, queries])
            window = queries if prev is None else torch.cat([prev, queries])
            state.window[layer] = window = window[-self.observation_window :]  # 0: all of them
        if budgets is None or kv_len <= budgets[layer]:
            return
        if view.head_lens is not None:  # a head-major layer whose heads hold different counts
            keep = self._select_ragged(self._head_scores(layer, window, view), view.head_lens, budgets[layer])
            self._pending.setdefault(rid, self._layers())[layer] = keep
            return
        if self.batches_compactions and not self.accumulates:  # scored with the layer's other compactions
            self._defer(layer, rid, ScoreInputs(window, view.keys, view.scale), budgets[layer])
            return
        if not self.accumulates:
            scores = self.score(layer, ScoreInputs(window, view.keys, view.scale))
        keep = self._select(scores, kv_len, budgets[layer])
        self._pending.setdefault(rid, self._layers())[layer] = keep
        if summed:
            self.decode_score_sums.compact(rid, layer, keep)
        elif self.accumulates:  # scores follow their tokens (one row: the shared order)
            state.scores[layer] = torch.gather(scores, 1, keep[: scores.shape[0]])

    def _select(self, scores: torch.Tensor | None, kv_len: int, budget: int) -> torch.Tensor:
        """``[num_kv_heads, budget]`` kept slots: sink, recent and the best-scored others."""
        sink, recent = self.protected(budget)
        middle = max(0, budget - sink - recent)
        if scores is None:
            if middle:
                raise ValueError(f"{self.name}: a budget above sink + recent needs an observation_window and score()")
            scores = torch.zeros(1, 0)  # not read: nothing to rank
        keep = keep_indices(scores, kv_len=kv_len, sink=sink, recent=recent, num_middle=middle)
        return keep.expand(self.shape.num_kv_heads, -1).contiguous()

    def _head_scores(self, layer: int, window: torch.Tensor, view: LayerAttention) -> torch.Tensor:
        """``[num_kv_heads, M]``: ``score()`` of each KV head over the slots it holds (``view.head_lens``),
        with its query group's observed queries; ``-inf`` past a head's slots."""
        if self.accumulates:
            raise NotImplementedError(f"{self.name} accumulates scores per slot: not over ragged heads")
        g = self.shape.group_size
        rows = [
            self.score(layer, ScoreInputs(window[:, h * g : (h + 1) * g], view.head_keys(h)[:, None], view.scale))[0]
            for h in range(len(view.head_lens))
        ]
        out = torch.full((len(rows), max(r.numel() for r in rows)), float("-inf"), device=window.device)
        for h, row in enumerate(rows):
            out[h, : row.numel()] = row
        return out

    def _select_ragged(self, scores: torch.Tensor, head_lens: tuple[int, ...], budget: int) -> torch.Tensor:
        """``_select`` for heads holding ``head_lens`` slots each (rows as ``Compaction.head_counts`` says):
        only a method whose heads keep their own counts (a head-major store) can."""
        raise NotImplementedError(f"{self.name} keeps one count per layer: it cannot compact ragged heads")

    def _compact_by_position(self, r: RequestStep, budgets: tuple[int, ...]) -> None:
        """A method that ranks nothing keeps sink and recent: decided before the forward, no inputs."""
        keeps = self._layers()
        for layer, budget in enumerate(budgets):
            kv_len = r.kv_lens[layer] + r.num_new_tokens
            if kv_len > budget:
                keeps[layer] = self._select(None, kv_len, budget)
        if any(k is not None for k in keeps):
            self._pending[r.request_id] = keeps

    def _defer(self, layer: int, request_id: Hashable, inputs: ScoreInputs, budget: int) -> None:
        deferred = self._deferred
        deferred.layer = layer
        deferred.add(request_id, inputs, budget)
        if deferred.elements >= MAX_SCORE_ELEMENTS:  # bounds the keys the batch holds
            self._flush()

    def _flush(self) -> None:
        """Score and select the deferred compactions of one layer, a batch per (budget, window length)."""
        deferred, self._deferred = self._deferred, DeferredSelections()
        for budget, batch in deferred.batches():
            scores = self.score_batch(deferred.layer, batch)
            sink, recent = self.protected(budget)
            keeps = keep_indices_batch(
                scores, batch.kv_lens, sink=sink, recent=recent, num_middle=budget - sink - recent
            )
            keeps = keeps.expand(-1, self.shape.num_kv_heads, -1).contiguous()
            for rid, keep in zip(batch.request_ids, keeps, strict=True):
                self._pending.setdefault(rid, self._layers())[deferred.layer] = keep

    def score_batch(self, layer: int, batch: ScoreBatch) -> torch.Tensor:
        """``[B, H, M]`` (``H``: ``score_heads`` rows) scores of a batch's requests, with ``M`` at least the
        slots before each request's recent ones (columns past a request's are not read): by default
        ``score()`` of each request alone."""
        rows = [self.score(layer, inputs) for inputs in _inputs(batch)]
        out = torch.zeros(len(rows), rows[0].shape[0], max(r.shape[1] for r in rows), device=rows[0].device)
        for b, row in enumerate(rows):
            out[b, :, : row.shape[1]] = row
        return out

    def finish_step(self) -> Mapping[Hashable, Compaction]:
        self._flush()
        out = {rid: Compaction(tuple(keep), rows=self._rows_of(rid, keep)) for rid, keep in self._pending.items()}
        self._pending, self._round_rows = {}, {}
        if self.query_ring is not None:
            for rid in self._observing:  # folded into their windows
                self.query_ring.clear(rid)
        return out

    # -- request events and chains -----------------------------------------------------------------
    def release(self, request_id: Hashable) -> object | None:
        state = self._states.pop(request_id, None)
        if state is not None:  # what the next turn resumes: the ring's pending queries folded into the
            state.window = self._folded_windows(request_id, state)  # windows, the scores copied out of the sums
            state.scores = self._saved_scores(request_id, state)
        for device_state in (self.query_ring, self.decode_score_sums):
            if device_state is not None:
                device_state.release(request_id)
        return state

    def _resumed(self, state: _RequestState | None) -> _RequestState:
        """A new request's state: fresh, or a copy of the chain's state it resumed (``RequestStep.resumed_state``).
        Stored tensors are replaced, never written in place, so copies of the lists are a safe snapshot."""
        if state is None:
            return _RequestState(window=self._layers(), scores=self._layers())
        return _RequestState(state.decoded, list(state.window), list(state.scores))


def _inputs(batch: ScoreBatch) -> list[ScoreInputs]:
    """Each request's ``ScoreInputs`` of a batch (slices of a tensor batch's gathered keys)."""
    if batch.paged is None:
        return batch.inputs
    lens = batch.kv_lens_cpu
    return [ScoreInputs(q, k[:n], batch.scale) for q, k, n in zip(batch.queries, batch.keys, lens, strict=True)]
