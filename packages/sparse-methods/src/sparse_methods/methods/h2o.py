"""H2O (heavy hitters): keep the tokens that have received the most attention, plus the recent ones.

Scores accumulate the columns of the attention probabilities: from the last
``h2o_prefill_score_window`` prompt queries (0: every prompt query, the paper's form), then one row
per generated token when decode eviction is on. At the end of prefill a prompt longer than
``h2o_prefill_budget`` keeps ``recent = budget * h2o_recent_ratio`` recent tokens and the best
``budget - recent`` others; with ``decode_eviction_interval`` set, every that many generated tokens
the cache is cut back to ``h2o_decode_budget`` the same way. SE shares one score vector per layer
across heads (``h2o_per_head=False``); the paper scores each head (``True``).

``prefill_sparse_method="h2o_prefill"`` compacts after every prefill chunk as well (scores from
each chunk's last ``h2o_prefill_score_window`` queries), so a long prompt never holds more than the
prefill budget plus one chunk.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

import torch
from pydantic import Field

from sparse_methods.base import (
    Category,
    LayerAttention,
    MemoryPlan,
    MethodConfig,
    PrefixCacheMode,
    RequestStep,
    StepContext,
)
from sparse_methods.eviction import EvictionMethod
from sparse_methods.registry import register, register_prefill_method
from sparse_methods.scoring import attention_column_sums, keep_indices


class H2OConfig(MethodConfig):
    h2o_prefill_budget: int = Field(8192, ge=1, description="Tokens kept at the end of prefill.")
    h2o_decode_budget: int = Field(4096, ge=1, description="Tokens kept by each decode eviction.")
    h2o_recent_ratio: float = Field(0.5, ge=0.0, le=1.0, description="Share of a budget given to recent tokens.")
    h2o_prefill_score_window: int = Field(
        128, ge=0, description="Last prompt (or chunk) queries whose attention is accumulated; 0 = all."
    )
    h2o_per_head: bool = Field(False, description="Score and select per KV head (paper) instead of per layer (SE).")
    decode_eviction_interval: int | None = Field(
        None, ge=1, description="Evict to h2o_decode_budget every this many generated tokens (None: never)."
    )
    prefill_sparse_method: Literal["h2o_prefill"] | None = Field(
        None, description="`h2o_prefill`: compact after every prefill chunk, not only the last."
    )


register_prefill_method("h2o_prefill", for_methods=frozenset({"h2o"}))


@register
class H2O(EvictionMethod):
    name = "h2o"
    category = Category.PHYSICAL_EVICTION
    prefix_cache_mode = PrefixCacheMode.CHAIN
    Config = H2OConfig

    def __init__(self, config: H2OConfig, shape) -> None:
        super().__init__(config, shape)
        self._scores: dict[Hashable, list[torch.Tensor | None]] = {}  # request -> layer -> [Hq, kv_len]
        self._decoded: dict[Hashable, int] = {}

    @property
    def chunked(self) -> bool:
        return self.config.prefill_sparse_method == "h2o_prefill"

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        c = self.config
        pb = c.h2o_prefill_budget
        prefill_peak = min(prompt_len, pb + chunk_size) if self.chunked else prompt_len
        resident = min(prompt_len, pb)
        grown = resident + max_new_tokens
        decode = (
            grown
            if c.decode_eviction_interval is None
            else min(grown, max(resident, c.h2o_decode_budget) + c.decode_eviction_interval)
        )
        return MemoryPlan.uniform(self.shape.num_layers, prefill_peak, resident, decode)

    def _scored_rows(self, r: RequestStep) -> int:
        """How many of the step's queries add to the scores (0: none)."""
        w = self.config.h2o_prefill_score_window
        if r.is_decode:
            return 1 if self.config.decode_eviction_interval is not None else 0
        if self.chunked:
            return r.num_new_tokens if w == 0 else min(w, r.num_new_tokens)
        # plain H2O: only the prompt's last `w` queries (or all) score, and only if it will compress
        if r.prompt_len <= self.config.h2o_prefill_budget:
            return 0
        first = r.start if w == 0 else max(r.start, r.prompt_len - w)
        return max(0, r.end - first)

    def select_requests(self, step: StepContext) -> dict[int, set[Hashable]]:
        wanted = {r.request_id for r in step.requests if self._scored_rows(r) > 0}
        return {layer: wanted for layer in range(self.shape.num_layers)} if wanted else {}

    def on_attention_end(self, layer: int, request: RequestStep, view: LayerAttention) -> None:
        c = self.config
        rid = request.request_id
        n_rows = self._scored_rows(request)
        kv_len = view.keys.shape[0]
        q = view.queries[-n_rows:]
        query_slots = torch.arange(kv_len - n_rows, kv_len, device=view.keys.device)
        add = attention_column_sums(q, view.keys, view.scale, query_slots=query_slots)  # [Hq, kv_len]
        per_layer = self._scores.setdefault(rid, [None] * self.shape.num_layers)
        prev = per_layer[layer]
        if prev is not None:
            add[:, : prev.shape[1]] += prev
        per_layer[layer] = add
        if request.is_decode:
            if layer == 0:
                self._decoded[rid] = self._decoded.get(rid, 0) + 1
            if self._decoded[rid] % c.decode_eviction_interval == 0:
                self._compress(rid, layer, kv_len, c.h2o_decode_budget)
        elif request.ends_prefill or self.chunked:
            self._compress(rid, layer, kv_len, c.h2o_prefill_budget)

    def _compress(self, rid: Hashable, layer: int, kv_len: int, budget: int) -> None:
        if kv_len <= budget:
            return
        scores = self._scores[rid][layer]
        recent = int(budget * self.config.h2o_recent_ratio)
        heavy = budget - recent
        hkv, g = self.shape.num_kv_heads, self.shape.group_size
        if self.config.h2o_per_head:
            per_kv = scores.view(hkv, g, -1).sum(1)
            keep = keep_indices(per_kv, kv_len=kv_len, sink=0, recent=recent, num_middle=heavy)
        else:
            shared = scores.sum(0, keepdim=True)
            keep = keep_indices(shared, kv_len=kv_len, sink=0, recent=recent, num_middle=heavy).expand(hkv, -1)
        self.evict(rid, layer, keep.contiguous())
        # Scores follow their tokens: per KV head when per-head, else the shared order for all heads.
        idx = keep.repeat_interleave(g, dim=0) if self.config.h2o_per_head else keep[:1].expand(hkv * g, -1)
        self._scores[rid][layer] = torch.gather(scores, 1, idx)

    def release(self, request_id: Hashable) -> None:
        self._scores.pop(request_id, None)
        self._decoded.pop(request_id, None)

    def save_state(self, request_id: Hashable) -> object | None:
        # Score tensors are replaced, never written in place once stored, so a tuple is a safe snapshot.
        scores = self._scores.get(request_id)
        return (tuple(scores) if scores is not None else None, self._decoded.get(request_id, 0))

    def restore_state(self, request_id: Hashable, state: object) -> None:
        scores, decoded = state
        if scores is not None:
            self._scores[request_id] = list(scores)
        if decoded:
            self._decoded[request_id] = decoded
