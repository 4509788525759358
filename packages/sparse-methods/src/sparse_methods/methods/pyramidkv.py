"""PyramidKV: SnapKV's scores with per-layer budgets that shrink linearly from the bottom layer to
the top (``pyramid_budgets``: KVCache-Factory's shape, average budget = sink + keep + recent).

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069). SE's choices: decode eviction on (every 1024 generated tokens back to each
layer's budget) and the ``long_bs1full_short_batch`` prefill policy. kvpress's PyramidKVPress
corresponds to ``sink_keep_tokens=0``, ``recent_keep_tokens=observation_window_size=64``, kernel 5,
avg pooling, with its budget from a compression ratio (``mean = L * (1 - ratio)``).
"""

from __future__ import annotations

from pydantic import Field

from sparse_methods.base import PrefillPolicy
from sparse_methods.eviction import Phase
from sparse_methods.methods.snapkv import SnapKV, SnapKVConfig
from sparse_methods.registry import register
from sparse_methods.scoring import pyramid_budgets


class PyramidKVConfig(SnapKVConfig):
    pyramidkv_beta: float = Field(20.0, ge=1.0, description="Pyramid steepness: the top layer keeps budget/beta.")
    decode_eviction_interval: int = Field(
        1024, ge=0, description="Evict back to each layer's budget every this many generated tokens (0: never)."
    )


@register
class PyramidKV(SnapKV):
    name = "pyramidkv"
    prefill_policy = PrefillPolicy.LONG_BS1FULL_SHORT_BATCH
    Config = PyramidKVConfig

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        uniform = super().budgets(prompt_len, phase)
        if uniform is None:
            return None
        c = self.config
        return tuple(
            pyramid_budgets(uniform[0], c.observation_window_size, prompt_len, self.shape.num_layers, c.pyramidkv_beta)
        )
