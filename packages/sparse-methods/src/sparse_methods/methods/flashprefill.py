"""FlashPrefill v2 (qhfan/FlashPrefillv2, arXiv 2608.19758): block-sparse prefill attention, usable with
every ``sparse_method`` as ``prefill_sparse_method="flashprefill_v2"``.

Each tile of ``flashprefill_v2_k_block_m`` packed query rows (a KV head's query group) scores the mean
key of every ``flashprefill_v2_k_block_n``-token block by the tile's softmax mass on it and reads the
blocks whose mass is at least ``flashprefill_v2_abs_threshold`` times the largest, plus the first
``flashprefill_v2_attention_sink_blocks`` and the ``flashprefill_v2_window_blocks`` local ones; the last
``flashprefill_v2_last_query_blocks`` tiles of a chunk and chunks of at most
``flashprefill_v2_min_sparse_q_len`` queries attend densely. With mean correction the dropped blocks
still enter the softmax as one pooled key/value each. Names and defaults are the published SparseEngine's;
its threshold has no default there (calibrate per model), ours is its Qwen3-4B starting point, 0.002.
The selection and kernel are ``sparse_kernels.block_sparse_prefill``; the method's KV store, selection
and evictions are untouched (a prefix-cache hit works: queries are the suffix of the cached KV).
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from sparse_methods._kernels import kernels
from sparse_methods.base import MethodConfig
from sparse_methods.prefill_attention import PrefillAttention
from sparse_methods.registry import register_prefill_attention


class FlashPrefillConfig(MethodConfig):
    flashprefill_v2_abs_threshold: float = Field(
        0.002,
        ge=0.0,
        le=1.0,
        description="Keep a key block whose softmax mass in a query tile is at least this "
        "fraction of the tile's largest block mass (0 keeps every block: dense; larger drops more; calibrate "
        "per model, 0.002 is SE's Qwen3-4B starting point).",
    )
    flashprefill_v2_k_block_m: int = Field(
        128, ge=16, multiple_of=16, description="Packed query rows (positions x group heads) per tile."
    )
    flashprefill_v2_k_block_n: int = Field(128, ge=16, description="Tokens per key block, a power of two.")
    flashprefill_v2_attention_sink_blocks: int = Field(2, ge=0, description="First key blocks every tile reads.")
    flashprefill_v2_window_blocks: int = Field(
        4, ge=1, description="Local key blocks each tile reads, ending at its own (at least 1)."
    )
    flashprefill_v2_last_query_blocks: int = Field(
        8, ge=0, description="Last query tiles of a chunk that attend densely."
    )
    flashprefill_v2_min_sparse_q_len: int = Field(
        4096, ge=0, description="Chunks of at most this many queries attend densely."
    )
    flashprefill_v2_use_mean_correction: bool = Field(
        True, description="Dropped blocks every row sees enter the softmax as pooled means."
    )

    @field_validator("flashprefill_v2_k_block_n")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value


@register_prefill_attention
class FlashPrefillV2(PrefillAttention):
    name = "flashprefill_v2"
    Config = FlashPrefillConfig

    def block_sparse_params(self):
        """The config as ``sparse_kernels``' ``BlockSparseParams``."""
        from sparse_kernels.prefill_block_selection import BlockSparseParams

        prefix = "flashprefill_v2_"
        return BlockSparseParams(**{k.removeprefix(prefix): v for k, v in self.config.model_dump().items()})

    def prefill_wrapper(self, device: torch.device):
        kernels()  # a clear error when sparse-kernels is not installed
        from sparse_kernels.block_sparse_prefill import BatchBlockSparsePrefillWithPagedKVCache

        return BatchBlockSparsePrefillWithPagedKVCache(device, params=self.block_sparse_params())
