"""SnapKV: at the end of prefill, score the prompt's tokens by the attention that the last
``observation_window_size`` prompt queries pay them, and keep per KV head the sink, the
best-scored ``decode_keep_tokens`` and the recent tokens (budget = sink + keep + recent).

Optionally (``decode_eviction_interval``) it re-scores with the latest decode queries and evicts
back to the budget every that many generated tokens. Scores: ``window_scores`` (``score_mode``
``probability`` is the paper's softmax; ``logits`` the raw maximum). kvpress's SnapKVPress is
``sink_keep_tokens=0, recent_keep_tokens=observation_window_size=64, score_kernel_size=5,
score_pooling="avg", score_gqa_reduce="mean"``; our defaults follow SE (window 32) and the
paper's pooling (max, kernel 7).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

import torch
from pydantic import Field, model_validator

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
from sparse_methods.registry import register
from sparse_methods.scoring import keep_indices, window_scores


class SnapKVConfig(MethodConfig):
    sink_keep_tokens: int = Field(64, ge=0, description="Leading tokens always kept, in tokens.")
    decode_keep_tokens: int = Field(7616, ge=0, description="Best-scored middle tokens kept, in tokens.")
    recent_keep_tokens: int = Field(512, ge=1, description="Most recent tokens always kept, in tokens.")
    observation_window_size: int = Field(32, ge=1, description="Last prompt queries whose attention scores tokens.")
    score_mode: Literal["probability", "logits"] = Field(
        "probability", description="`probability`: softmax over the window; `logits`: max raw q.k."
    )
    score_kernel_size: int = Field(7, ge=1, description="Pooling kernel along tokens (odd), in tokens.")
    score_pooling: Literal["max", "avg", "none"] = Field("max", description="Pooling of scores along tokens.")
    score_gqa_reduce: Literal["mean", "max", "sum"] = Field(
        "mean", description="How a KV group's query heads' scores combine into the KV head's score."
    )
    decode_eviction_interval: int | None = Field(
        None, ge=1, description="Evict back to the budget every this many generated tokens (None: never)."
    )

    @model_validator(mode="after")
    def _window_inside_recent(self):
        if self.recent_keep_tokens < self.observation_window_size:
            raise ValueError(
                f"recent_keep_tokens ({self.recent_keep_tokens}) must cover observation_window_size "
                f"({self.observation_window_size}): the window's own tokens are always kept"
            )
        return self


@register
class SnapKV(EvictionMethod):
    name = "snapkv"
    category = Category.PHYSICAL_EVICTION
    prefix_cache_mode = PrefixCacheMode.CHAIN
    Config = SnapKVConfig

    def __init__(self, config: SnapKVConfig, shape) -> None:
        super().__init__(config, shape)
        # request -> layer -> recent queries [n, Hq, D] (prompt window, then latest decode queries)
        self._window: dict[Hashable, list[torch.Tensor | None]] = {}
        self._decoded: dict[Hashable, int] = {}

    @property
    def budget(self) -> int:
        c = self.config
        return c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens

    def layer_budgets(self, prompt_len: int) -> list[int]:
        """Tokens each layer keeps when a prompt of ``prompt_len`` tokens is compressed."""
        return [self.budget] * self.shape.num_layers

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        interval = self.config.decode_eviction_interval
        prefill, resident, decode = [], [], []
        for budget in self.layer_budgets(prompt_len):
            kept = min(prompt_len, budget)  # the whole prompt is held until the end of prefill
            prefill.append(prompt_len)
            resident.append(kept)
            grown = kept + max_new_tokens
            decode.append(grown if interval is None else min(grown, budget + interval))
        return MemoryPlan(tuple(prefill), tuple(resident), tuple(decode))

    # -- which steps need attention inputs --------------------------------------------------------
    def select_requests(self, step: StepContext) -> dict[int, set[Hashable]]:
        w = self.config.observation_window_size
        interval = self.config.decode_eviction_interval
        wanted = set()
        for r in step.requests:
            if not r.is_decode:
                if r.end > r.prompt_len - w and r.prompt_len > min(self.layer_budgets(r.prompt_len)):
                    wanted.add(r.request_id)  # this chunk holds window queries of a prompt to compress
            elif interval is not None:
                wanted.add(r.request_id)  # keep the latest decode queries for the next re-scoring
        return {layer: wanted for layer in range(self.shape.num_layers)} if wanted else {}

    def _stash(self, rid: Hashable, layer: int, q: torch.Tensor) -> torch.Tensor:
        slots = self._window.setdefault(rid, [None] * self.shape.num_layers)
        prev = slots[layer]
        q = q if prev is None else torch.cat([prev, q])
        slots[layer] = q = q[-self.config.observation_window_size :]
        return q

    def on_attention_end(self, layer: int, request: RequestStep, view: LayerAttention) -> None:
        c = self.config
        rid = request.request_id
        w = c.observation_window_size
        if not request.is_decode:
            first = max(0, request.prompt_len - w - request.start)  # rows of this chunk inside the window
            q = self._stash(rid, layer, view.queries[first:])
            if request.ends_prefill:
                self._compress(rid, layer, q, view, self.layer_budgets(request.prompt_len)[layer])
            return
        q = self._stash(rid, layer, view.queries)
        if layer == 0:
            self._decoded[rid] = self._decoded.get(rid, 0) + 1
        if self._decoded[rid] % c.decode_eviction_interval == 0:
            self._compress(rid, layer, q, view, self.layer_budgets(request.prompt_len)[layer])

    def _compress(self, rid: Hashable, layer: int, q: torch.Tensor, view: LayerAttention, budget: int) -> None:
        c = self.config
        kv_len = view.keys.shape[0]
        if kv_len <= budget:
            return
        n = q.shape[0]
        query_slots = torch.arange(kv_len - n, kv_len, device=view.keys.device)
        recent = max(c.recent_keep_tokens, n)
        scores = window_scores(
            q,
            view.keys,
            view.scale,
            query_slots=query_slots,
            num_scored=kv_len - n,
            score_mode=c.score_mode,
            kernel_size=c.score_kernel_size,
            pooling=c.score_pooling,
            group_reduce=c.score_gqa_reduce,
        )
        sink = min(c.sink_keep_tokens, budget)
        middle = max(0, budget - sink - recent)
        keep = keep_indices(scores, kv_len=kv_len, sink=sink, recent=min(recent, budget - sink), num_middle=middle)
        self.evict(rid, layer, keep)

    def release(self, request_id: Hashable) -> None:
        self._window.pop(request_id, None)
        self._decoded.pop(request_id, None)

    def save_state(self, request_id: Hashable) -> object | None:
        # Tensors are never written in place here, so a tuple of them is a safe snapshot.
        window = self._window.get(request_id)
        return (tuple(window) if window is not None else None, self._decoded.get(request_id, 0))

    def restore_state(self, request_id: Hashable, state: object) -> None:
        window, decoded = state
        if window is not None:
            self._window[request_id] = list(window)
        if decoded:
            self._decoded[request_id] = decoded
