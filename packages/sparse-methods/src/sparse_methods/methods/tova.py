"""TOVA: at each eviction keep the tokens that the most recent query attends to most, averaged over
every attention head of the layer (one kept set per layer, shared by its KV heads).

Oren et al., "Transformers are Multi-State RNNs" (arXiv:2401.06104), schwartz-lab-NLP/TOVA. The
paper evicts after every attention call once the cache is over its size: after each prefill chunk
(the chunk's last query scores), at the end of the prompt and every ``decode_eviction_interval``
generated tokens (1, every step, as the paper; a larger interval lets the cache grow by that much
between evictions and trades exactness for fewer compactions). Budget = sink + keep + recent.

kvpress's TOVAPress is ``sink_keep_tokens=0, recent_keep_tokens=1`` (it pads the last token's score
above every other so the newest token is never dropped) with ``decode_keep_tokens = n_kept - 1``;
those are our defaults too, with SE's ``decode_keep_tokens=4096`` (the paper keeps no sinks: its
finding is that the first token survives on its own).
"""

from __future__ import annotations

import torch
from pydantic import Field

from sparse_methods.base import MethodConfig, Support
from sparse_methods.eviction import EvictionMethod, Phase, ScoreInputs
from sparse_methods.registry import register
from sparse_methods.scoring import attention_column_sums


class TOVAConfig(MethodConfig):
    sink_keep_tokens: int = Field(0, ge=0, description="Leading tokens always kept, in tokens.")
    decode_keep_tokens: int = Field(4096, ge=0, description="Tokens kept by the last query's attention, in tokens.")
    recent_keep_tokens: int = Field(1, ge=1, description="Most recent tokens always kept, in tokens.")
    decode_eviction_interval: int = Field(
        1, ge=0, description="Evict back to the budget every this many generated tokens (0: never)."
    )


@register
class TOVA(EvictionMethod):
    name = "tova"
    Config = TOVAConfig
    # Tensor parallel: the mean over heads is the mean of the shards' means (equal shards).
    supports = EvictionMethod.supports | {Support.TENSOR_PARALLEL}

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...]:
        c = self.config
        return (c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens,) * self.shape.num_layers

    @property
    def observation_window(self) -> int:
        return 1  # the most recent query only

    def score(self, layer: int, inputs: ScoreInputs) -> torch.Tensor:
        """``[1, kv_len]``: the last query's attention probabilities, averaged over all query heads (of
        every shard)."""
        probs = attention_column_sums(
            inputs.queries[-1:], inputs.keys, inputs.scale, query_slots=inputs.query_slots[-1:]
        )  # [num_q_heads, kv_len]: one query, so its probabilities
        reduction = self.head_reduction
        return reduction.sum(probs.mean(0, keepdim=True)) / reduction.num_shards
