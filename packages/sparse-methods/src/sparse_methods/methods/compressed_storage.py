"""Compressed-storage methods: every token is kept and read, in a quantized KV store.

``fp8_kv``, ``kivi`` and ``turboquant`` select nothing and evict nothing: they name the KV store
the engine builds (``kv_cache_dtype``). The store's quantization parameters (``kivi_bits``,
``kv_quant_page_size``, ``turboquant_bits``, ``turboquant_seed``, ``fp8_kv_scale_path``) are engine
fields of the KV-dtype axis, so any other method can run over the same stores
(``sparse_method="snapkv", kv_cache_dtype="fp8"``); choosing one of these methods is the same as
``sparse_method="dense"`` with its ``kv_cache_dtype``.
"""

from __future__ import annotations

from sparse_methods.base import Category, MemoryPlan, MethodConfig, PrefixCacheMode, SparseMethod, Storage, Support
from sparse_methods.registry import register


class CompressedStorageConfig(MethodConfig):
    pass


class _CompressedStorage(SparseMethod):
    category = Category.COMPRESSED_STORAGE
    prefix_cache_mode = PrefixCacheMode.RADIX  # codes are a function of the tokens: radix sharing holds
    Config = CompressedStorageConfig
    supports = frozenset({Support.TENSOR_PARALLEL})  # codes and scales per KV head (KIVI's per channel and head)

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len, prompt_len, prompt_len + max_new_tokens)


@register
class Fp8KV(_CompressedStorage):
    """e4m3 K/V with a scale per (token, KV head) (or static per-layer scales from a file)."""

    name = "fp8_kv"
    storage = Storage(kv_cache_dtype="fp8")


@register
class Kivi(_CompressedStorage):
    """KIVI: 2/4-bit keys per channel over a page, values per token over channel groups, a full-
    precision tail for the incomplete page."""

    name = "kivi"
    storage = Storage(kv_cache_dtype="kivi")


@register
class TurboQuant(_CompressedStorage):
    """TurboQuant (MSE variant): a seeded random rotation and a Lloyd-Max codebook for a unit
    Gaussian, scaled per (token, KV head); attention runs in the rotated space."""

    name = "turboquant"
    storage = Storage(kv_cache_dtype="turboquant")
