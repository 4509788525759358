"""StreamingLLM: keep the first ``sink_keep_tokens`` (attention sinks) and the last
``recent_keep_tokens``; evict the middle whenever the cache is over budget.

Eviction happens between prefill chunks (so a long prompt never holds more than the budget plus
one chunk) and during decode once ``decode_eviction_interval`` tokens have piled up past the
budget (compacting every step would move the recent window each step). Original positions are
kept (as kvpress and SE do; the paper's "pos shift" re-rotation is not applied).
"""

from __future__ import annotations

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
from sparse_methods.registry import register


class StreamingLLMConfig(MethodConfig):
    sink_keep_tokens: int = Field(64, ge=0, description="Leading tokens always kept (attention sinks), in tokens.")
    recent_keep_tokens: int = Field(512, ge=1, description="Most recent tokens always kept, in tokens.")
    decode_eviction_interval: int | None = Field(
        16, ge=1, description="During decode, evict once this many tokens exceed the budget (tokens)."
    )


def streaming_keep(kv_len: int, sink: int, recent: int, num_heads: int, device=None) -> torch.Tensor:
    """``[num_heads, n]`` slots kept by StreamingLLM: ``[0, sink) U [kv_len - recent, kv_len)``."""
    if kv_len <= sink + recent:
        idx = torch.arange(kv_len, device=device)
    else:
        idx = torch.cat([torch.arange(sink, device=device), torch.arange(kv_len - recent, kv_len, device=device)])
    return idx.expand(num_heads, -1).contiguous()


@register
class StreamingLLM(EvictionMethod):
    name = "streamingllm"
    category = Category.PHYSICAL_EVICTION
    prefix_cache_mode = PrefixCacheMode.CHAIN
    Config = StreamingLLMConfig

    @property
    def budget(self) -> int:
        return self.config.sink_keep_tokens + self.config.recent_keep_tokens

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        total = prompt_len + max_new_tokens
        interval = self.config.decode_eviction_interval or total
        prefill_peak = min(prompt_len, self.budget + chunk_size)
        resident = min(prompt_len, self.budget)
        decode_peak = min(total, max(resident, self.budget + interval))
        return MemoryPlan.uniform(self.shape.num_layers, prefill_peak, resident, decode_peak)

    def _over_budget(self, request: RequestStep) -> bool:
        kv_len = request.kv_lens[0] + request.num_new_tokens
        if kv_len <= self.budget:
            return False
        if not request.is_decode:
            return True  # prefill: never carry more than the budget into the next chunk
        interval = self.config.decode_eviction_interval
        return interval is not None and kv_len - self.budget >= interval

    def prepare_step(self, step: StepContext) -> None:
        super().prepare_step(step)
        # StreamingLLM needs no attention inputs: the kept set depends on lengths only.
        for r in step.requests:
            if self._over_budget(r):
                for layer in range(self.shape.num_layers):
                    kv_len = self.kv_len_after(r, layer)
                    keep = streaming_keep(
                        kv_len, self.config.sink_keep_tokens, self.config.recent_keep_tokens, self.shape.num_kv_heads
                    )
                    self.evict(r.request_id, layer, keep)

    def on_attention_end(self, layer: int, request: RequestStep, view: LayerAttention) -> None:
        raise AssertionError("streamingllm asks for no attention inputs")
