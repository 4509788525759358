"""SnapKV: at the end of prefill, score the prompt's tokens by the attention that the last
``observation_window_size`` prompt queries pay them, and keep per KV head the sink, the
best-scored ``decode_keep_tokens`` and the recent tokens (budget = sink + keep + recent).

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv:2404.14469).
Optionally (``decode_eviction_interval``) it re-scores with the latest decode queries and evicts
back to the budget every that many generated tokens. Scores: ``window_scores`` (``score_mode``
``probability`` is the paper's softmax; ``logits`` the raw maximum). kvpress's SnapKVPress is
``sink_keep_tokens=0, recent_keep_tokens=observation_window_size=64, score_kernel_size=5,
score_pooling="avg", score_gqa_reduce="mean"``; our defaults follow SE (window 32) and the
paper's pooling (max, kernel 7).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from sparse_methods._kernels import kernels
from sparse_methods.attention_batch import PagedKeys
from sparse_methods.base import MethodConfig, Support
from sparse_methods.deferred_selections import ScoreBatch
from sparse_methods.eviction import EvictionMethod, Phase, ScoreInputs
from sparse_methods.registry import register
from sparse_methods.scoring import reduce_window_probs, window_scores, window_scores_batch


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
    decode_eviction_interval: int = Field(
        0, ge=0, description="Evict back to the budget every this many generated tokens (0: never)."
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
    Config = SnapKVConfig
    # MLA: scores through the absorbed queries (one KV head of latent + rope channels); tensor parallel:
    # per-KV-head scores over the whole query group.
    supports = frozenset(Support)

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        c = self.config
        if phase is Phase.CHUNK:
            return None  # the whole prompt is held until its end
        return (c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens,) * self.shape.num_layers

    @property
    def observation_window(self) -> int:
        return self.config.observation_window_size

    def score(self, layer: int, inputs: ScoreInputs) -> torch.Tensor:
        """Window scores of the slots before the window (the window itself is within the recent tokens)."""
        c = self.config
        return window_scores(
            inputs.queries,
            inputs.keys,
            inputs.scale,
            query_slots=inputs.query_slots,
            num_scored=inputs.keys.shape[0] - inputs.queries.shape[0],
            score_mode=c.score_mode,
            kernel_size=c.score_kernel_size,
            pooling=c.score_pooling,
            group_reduce=c.score_gqa_reduce,
        )

    def _from_pages(self, keys: PagedKeys) -> bool:
        return keys.k_cache.is_cuda and self.config.score_mode == "probability"

    def batch_elements_per_key(self, keys: PagedKeys) -> int:
        """From the pages: the probabilities of each query head only (no logits)."""
        return self.shape.num_q_heads if self._from_pages(keys) else super().batch_elements_per_key(keys)

    def score_batch(self, layer: int, batch: ScoreBatch) -> torch.Tensor:
        """Every request's window scores at once: on a GPU, the probabilities straight from the pages
        (``sparse_kernels.window_probs``: no gathered keys, no logits); else ``window_scores_batch``."""
        c = self.config
        paged = batch.paged
        if paged is not None and self._from_pages(paged):
            n, heads = batch.queries.shape[1], paged.k_cache.shape[2]
            probs = kernels().window_probs(
                batch.queries, paged.k_cache, paged.block_table, paged.kv_lens, batch.scale, max_len=paged.max_len
            )  # [B, Hq, L]
            grouped = probs.view(probs.shape[0], heads, -1, paged.max_len)[..., : paged.max_len - n]
            return reduce_window_probs(grouped, c.score_kernel_size, c.score_pooling, c.score_gqa_reduce)
        return window_scores_batch(
            batch.queries,
            batch.keys,
            batch.kv_lens,
            batch.scale,
            score_mode=c.score_mode,
            kernel_size=c.score_kernel_size,
            pooling=c.score_pooling,
            group_reduce=c.score_gqa_reduce,
        )
