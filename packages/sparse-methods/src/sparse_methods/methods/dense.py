"""Dense attention: every token's KV is kept and read (the baseline every method is compared to)."""

from __future__ import annotations

from sparse_methods.base import Category, MemoryPlan, MethodConfig, PrefixCacheMode, SparseMethod, Support
from sparse_methods.registry import register


class DenseConfig(MethodConfig):
    pass


@register
class Dense(SparseMethod):
    name = "dense"
    category = Category.DENSE
    prefix_cache_mode = PrefixCacheMode.RADIX
    supports = frozenset(Support)
    Config = DenseConfig

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len, prompt_len, prompt_len + max_new_tokens)
