"""H2O (heavy hitters): keep the tokens that have received the most attention, plus the recent ones.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (arXiv:2306.14048). Scores accumulate the columns of the attention probabilities: from the
last ``h2o_prefill_score_window`` prompt queries (0: every prompt query, the paper's form), then
one row per generated token when decode eviction is on. At the end of prefill a prompt longer than
``h2o_prefill_budget`` keeps ``recent = budget * h2o_recent_ratio`` recent tokens and the best
``budget - recent`` others; with ``decode_eviction_interval`` set, every that many generated tokens
the cache is cut back to ``h2o_decode_budget`` the same way. SE shares one score vector per layer
across heads (``h2o_per_head=False``); the paper scores each head (``True``).

``prefill_sparse_method="h2o_prefill"`` compacts after every prefill chunk as well (scores from
each chunk's last ``h2o_prefill_score_window`` queries), so a long prompt never holds more than the
prefill budget plus one chunk.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from sparse_methods.base import MethodConfig, Support
from sparse_methods.eviction import EvictionMethod, Phase, ScoreInputs
from sparse_methods.registry import register, register_prefill_method
from sparse_methods.scoring import attention_column_sums


class H2OConfig(MethodConfig):
    h2o_prefill_budget: int = Field(8192, ge=1, description="Tokens kept at the end of prefill.")
    h2o_decode_budget: int = Field(4096, ge=1, description="Tokens kept by each decode eviction.")
    h2o_recent_ratio: float = Field(0.5, ge=0.0, le=1.0, description="Share of a budget given to recent tokens.")
    h2o_prefill_score_window: int = Field(
        128, ge=0, description="Last prompt (or chunk) queries whose attention is accumulated; 0 = all."
    )
    h2o_per_head: bool = Field(False, description="Score and select per KV head (paper) instead of per layer (SE).")
    decode_eviction_interval: int = Field(
        0, ge=0, description="Evict to h2o_decode_budget every this many generated tokens (0: never)."
    )
    prefill_sparse_method: Literal["h2o_prefill"] | None = Field(
        None, description="`h2o_prefill`: compact after every prefill chunk, not only the last."
    )


register_prefill_method("h2o_prefill", for_methods=frozenset({"h2o"}))


@register
class H2O(EvictionMethod):
    name = "h2o"
    Config = H2OConfig
    # MLA: scores through the absorbed queries (one KV head of latent + rope channels); tensor parallel: per
    # KV head, or a shared score summed over the shards' heads.
    supports = frozenset(Support)
    accumulates = True

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        c = self.config
        if phase is Phase.CHUNK and c.prefill_sparse_method != "h2o_prefill":
            return None
        return (c.h2o_decode_budget if phase is Phase.DECODE else c.h2o_prefill_budget,) * self.shape.num_layers

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, int(budget * self.config.h2o_recent_ratio)

    @property
    def observation_window(self) -> int:
        return self.config.h2o_prefill_score_window

    @property
    def score_heads(self) -> int:
        return self.shape.num_kv_heads if self.config.h2o_per_head else 1

    def score(self, layer: int, inputs: ScoreInputs) -> torch.Tensor:
        """This step's attention paid to every slot, summed over its queries and the KV head's query
        group (``[num_kv_heads, kv_len]``) or over every query head (``[1, kv_len]``, shared)."""
        sums = attention_column_sums(inputs.queries, inputs.keys, inputs.scale, query_slots=inputs.query_slots)
        if self.config.h2o_per_head:
            return sums.view(self.shape.num_kv_heads, self.shape.group_size, -1).sum(1)
        return self.head_reduction.sum(sums.sum(0, keepdim=True))
