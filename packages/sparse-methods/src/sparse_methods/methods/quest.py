"""Quest: query-aware page selection. Every token's KV stays resident (token-exact, radix prefix
cache); at each decode step and layer, the query bounds each page's best possible ``q.k`` from the
page's elementwise key min/max (``select_decode``) and attends only to the sink pages, the best
``decode_keep_tokens / quest_chunk_size`` pages and the recent pages (the newest always among them).

Summaries live in the engine's ``paged + block summaries`` store (int8 codes rounded outward with a
scale per page and KV head by default, ``quest_summary_dtype``), updated whenever a block is
written (prefill chunks and decode steps) and kept with the block, so prefix-cache hits reuse
them. The first ``quest_skip_layers`` layers and contexts within the budget stay dense. GQA: a KV
head's bound is the maximum over its query heads, so one page list serves the whole group.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from sparse_methods._kernels import kernels
from sparse_methods.base import (
    DENSE_LAYER,
    Category,
    DecodeBatch,
    DecodeRead,
    LayerPlan,
    MemoryPlan,
    MethodConfig,
    ModelShape,
    PrefixCacheMode,
    SparseMethod,
    Storage,
    StoreKind,
    Support,
)
from sparse_methods.registry import register


class QuestConfig(MethodConfig):
    sink_keep_tokens: int = Field(64, ge=0, description="Leading tokens always read, in tokens (rounded up to pages).")
    decode_keep_tokens: int = Field(1472, ge=0, description="Tokens read from the best-bounded pages, in tokens.")
    recent_keep_tokens: int = Field(512, ge=1, description="Most recent tokens always read (rounded up to pages).")
    quest_chunk_size: int = Field(16, ge=1, description="Tokens per summarized page (must equal block_size).")
    quest_skip_layers: int = Field(2, ge=0, description="First layers that always read every page.")
    quest_summary_dtype: Literal["int8", "model"] = Field(
        "int8",
        description="Page summaries' storage: int8 codes rounded outward with a scale per (page, KV head), half "
        "the bytes each step's bounds read and still upper bounds, or the model dtype (exact min / max). Over a "
        "KIVI store neither: its pages' own key statistics (per-channel min and step) bound them.",
    )


_SELECT_PAGES = LayerPlan(DecodeRead.SELECTED)


@register
class Quest(SparseMethod):
    name = "quest"
    category = Category.QUERY_AWARE_SELECTION
    prefix_cache_mode = PrefixCacheMode.RADIX
    storage = Storage(StoreKind.PAGED_WITH_SUMMARIES)
    # Sliding windows: selects pages in full-attention layers (windowed ones stay dense); MLA: bounds the
    # absorbed queries against the latent + rope rows' page min / max; tensor parallel: per-KV-head page
    # bounds over the whole query group.
    supports = frozenset(Support)
    Config = QuestConfig

    def __init__(self, config: QuestConfig, shape: ModelShape) -> None:
        super().__init__(config, shape)
        summaries = StoreKind.PAGED_WITH_SUMMARIES
        self.storage = Storage(summaries, summary_dtype=config.quest_summary_dtype, page_tokens=config.quest_chunk_size)

    @property
    def budget(self) -> int:
        c = self.config
        return c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len, prompt_len, prompt_len + max_new_tokens)

    def layer_plan(self, layer: int) -> LayerPlan:
        return _SELECT_PAGES if layer >= self.config.quest_skip_layers else DENSE_LAYER

    def _pages(self, page: int) -> tuple[int, int, int]:
        """Sink, best and recent pages of ``page`` tokens (the engine's block, summarized by the store)."""
        c = self.config
        if page != c.quest_chunk_size:
            raise ValueError(f"quest summarizes pages of {c.quest_chunk_size} tokens; set block_size to match ({page})")
        return (
            math.ceil(c.sink_keep_tokens / page),
            c.decode_keep_tokens // page,
            max(1, math.ceil(c.recent_keep_tokens / page)),
        )

    def selection_size(self, kv_len: int, page_size: int) -> int | None:
        if kv_len <= self.budget or -(-kv_len // page_size) <= sum(self._pages(page_size)):
            return None
        return sum(self._pages(page_size))

    def select_decode(self, layer: int, batch: DecodeBatch) -> torch.Tensor:
        """Quest's only selection (any device; the kernels' reference backends run on CPU): each page's
        bound ``sum_d max(q_d * max_d, q_d * min_d)``, the max over the KV head's query group, read
        through each row's table (``sparse_kernels.page_bounds``: sink and recent pages forced to +inf,
        pages past the row to -inf), then the top ``sink + keep + recent`` per KV head in ascending page
        order (``top_k_ascending``: ties to the earlier page)."""
        sink, keep, recent = self._pages(batch.block_size)
        k = kernels()
        query = batch.query
        # bfloat16 bounds: the ranking keeps 8 significant bits (int8 summaries already round a bound by up
        # to 1/127 of its head's scale per channel), and the top-k's radix passes over 16-bit keys are half
        # of float32's.
        bounds = torch.empty(
            query.shape[0], self.shape.num_kv_heads, batch.max_pages, dtype=torch.bfloat16, device=query.device
        )
        k.page_bounds(
            query,
            batch.page_min,
            batch.page_max,
            batch.table_indices,
            batch.table_start,
            batch.num_pages,
            bounds,
            sink=sink,
            recent=recent,
            scale=batch.page_scale,
            levels=batch.page_levels,
        )
        return k.top_k_ascending(bounds, min(sink + keep + recent, batch.max_pages))
