"""StreamingLLM: keep the first ``sink_keep_tokens`` (attention sinks) and the last
``recent_keep_tokens``; evict the middle whenever the cache is over budget.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (arXiv:2309.17453).
Eviction happens after every prefill chunk (a long prompt never holds more than the budget plus one
chunk) and every ``decode_eviction_interval`` generated tokens (compacting every step would move
the recent window each step). The kept set depends on positions only, so the method asks for no
attention inputs. Original positions are kept (as kvpress and SE do; the paper's "pos shift"
re-rotation is not applied).
"""

from __future__ import annotations

from pydantic import Field

from sparse_methods.base import MethodConfig, Support
from sparse_methods.eviction import EvictionMethod, Phase
from sparse_methods.registry import register


class StreamingLLMConfig(MethodConfig):
    sink_keep_tokens: int = Field(64, ge=0, description="Leading tokens always kept (attention sinks), in tokens.")
    recent_keep_tokens: int = Field(512, ge=1, description="Most recent tokens always kept, in tokens.")
    decode_eviction_interval: int = Field(
        16, ge=0, description="Evict back to the budget every this many generated tokens (0: never)."
    )


@register
class StreamingLLM(EvictionMethod):
    name = "streamingllm"
    Config = StreamingLLMConfig
    supports = frozenset(Support)  # the kept set depends on positions only (any KV head layout)

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...]:
        return (self.config.sink_keep_tokens + self.config.recent_keep_tokens,) * self.shape.num_layers
