"""R-KV: decode-time eviction for reasoning traces, ranking tokens by importance minus redundancy.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (arXiv:2505.24133),
Zefan-Cai/R-KV. The prompt is never compressed. Every ``rkv_compression_interval`` generated tokens
a cache over the budget B = sink + keep + recent (only the total counts: no fixed sink) is cut back
to B: the last ``rkv_observation_tokens`` (W) tokens are kept, and the best B - W others by

    score = rkv_alpha * importance - (1 - rkv_alpha) * redundancy

per KV head (``rkv_importance``, ``rkv_redundancy``). Parameter names and defaults are SE's
(interval 128, W 8, alpha 0.1, kernel 7, a 512 MiB scoring workspace). SE ranks one set for all
layers and heads (scores averaged over KV heads and summed over layers); here each layer and KV
head keeps its own top tokens, as in R-KV's reference code.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from sparse_methods.base import MethodConfig, Support
from sparse_methods.eviction import EvictionMethod, Phase, ScoreInputs
from sparse_methods.registry import register
from sparse_methods.scoring import pool_scores

SIMILARITY_THRESHOLD = 0.5  # R-KV's and SE's (SE rejects any other value)


def rkv_importance(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, *, num_scored: int, kernel_size: int
) -> torch.Tensor:
    """``[num_kv_heads, num_scored]`` attention that the observed queries pay the first ``num_scored``
    slots: raw ``q.k * scale``, max over each KV head's query group, softmax over those slots only
    (float32), mean over the queries, max-pooled along tokens (``kernel_size``, stride 1).

    ``queries``: ``[n, num_q_heads, D]``; ``keys``: ``[L, num_kv_heads, D]``, ``num_scored <= L``.
    """
    n, num_q_heads, d = queries.shape
    num_kv_heads = keys.shape[1]
    g = num_q_heads // num_kv_heads
    q = queries.float().view(n, num_kv_heads, g, d).permute(1, 2, 0, 3).reshape(num_kv_heads, g * n, d)
    k = keys[:num_scored].float().permute(1, 2, 0)  # [Hkv, D, M]
    logits = torch.bmm(q, k).mul_(scale).view(num_kv_heads, g, n, num_scored).amax(1)  # [Hkv, n, M]
    return pool_scores(torch.softmax(logits, dim=-1).mean(1), kernel_size, "max")


def rkv_redundancy(keys: torch.Tensor, *, max_elements: int = 1 << 26) -> torch.Tensor:
    """``[num_kv_heads, L]`` redundancy of every slot: softmax over slots of the mean, over rows ``i``,
    of the cosine similarity ``S[i, j]`` between keys, with ``S[i, i] = 0`` and, in each row, the
    last ``j`` with ``S[i, j] > 0.5`` (``j = 0`` if none) zeroed: a token's most recent near-copy is
    not counted against it by that token.

    Rows are computed in tiles of at most ``max_elements`` similarities (all KV heads at once), so the
    workspace stays bounded however long the trace.
    """
    num_keys, num_kv_heads, _ = keys.shape
    k = keys.float().transpose(0, 1)  # [Hkv, L, D]
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    cols = torch.arange(num_keys, device=keys.device, dtype=torch.int32)
    sums = torch.zeros(num_kv_heads, num_keys, device=keys.device)
    rows = max(1, max_elements // (num_kv_heads * num_keys))
    for start in range(0, num_keys, rows):
        stop = min(num_keys, start + rows)
        sim = torch.bmm(k[:, start:stop], k.transpose(1, 2))  # [Hkv, r, L]
        own = torch.arange(start, stop, device=keys.device)
        sim[:, own - start, own] = 0.0
        last = torch.where(sim > SIMILARITY_THRESHOLD, cols, 0).amax(-1, keepdim=True)  # [Hkv, r, 1]
        sums += sim.scatter_(-1, last.long(), 0.0).sum(1)
    return torch.softmax(sums / num_keys, dim=-1)


class RKVConfig(MethodConfig):
    sink_keep_tokens: int = Field(
        64, ge=0, description="Counted in the budget sink + keep + recent, in tokens (no leading tokens are protected)."
    )
    decode_keep_tokens: int = Field(4096, ge=0, description="Counted in the budget sink + keep + recent, in tokens.")
    recent_keep_tokens: int = Field(
        512,
        ge=0,
        description="Counted in the budget sink + keep + recent, in tokens (rkv_observation_tokens are protected).",
    )
    rkv_compression_interval: int = Field(
        128, ge=1, description="Cut the cache back to the budget every this many generated tokens."
    )
    rkv_observation_tokens: int = Field(
        8, ge=1, description="Latest generated tokens whose queries score importance; always kept."
    )
    rkv_alpha: float = Field(
        0.1, ge=0.0, le=1.0, description="Weight of importance: score = alpha * importance - (1 - alpha) * redundancy."
    )
    rkv_kernel_size: int = Field(7, ge=1, description="Max-pooling kernel of importance along tokens (odd).")
    rkv_score_chunk_mb: int = Field(512, ge=1, description="Workspace of the pairwise key similarities, in MiB.")

    @model_validator(mode="after")
    def _check(self):
        budget = self.sink_keep_tokens + self.decode_keep_tokens + self.recent_keep_tokens
        if self.rkv_observation_tokens > self.rkv_compression_interval:
            raise ValueError("rkv_observation_tokens must be <= rkv_compression_interval")
        if budget <= self.rkv_observation_tokens:
            raise ValueError(f"the budget sink + keep + recent ({budget}) must exceed rkv_observation_tokens")
        if self.rkv_kernel_size % 2 == 0:
            raise ValueError(f"rkv_kernel_size must be odd, got {self.rkv_kernel_size}")
        return self


@register
class RKV(EvictionMethod):
    name = "rkv"
    Config = RKVConfig
    supports = EvictionMethod.supports | {Support.TENSOR_PARALLEL}  # importance and redundancy per KV head

    @property
    def _interval(self) -> int:
        return self.config.rkv_compression_interval

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        c = self.config
        if phase is not Phase.DECODE:  # the prompt is never compressed
            return None
        return (c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens,) * self.shape.num_layers

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, min(self.config.rkv_observation_tokens, budget)

    @property
    def observation_window(self) -> int:
        return self.config.rkv_observation_tokens

    def score(self, layer: int, inputs: ScoreInputs) -> torch.Tensor:
        """``[num_kv_heads, L - n]`` scores of the slots before the ``n`` observed (always kept) ones."""
        c = self.config
        scored = inputs.keys.shape[0] - inputs.queries.shape[0]
        importance = rkv_importance(
            inputs.queries, inputs.keys, inputs.scale, num_scored=scored, kernel_size=c.rkv_kernel_size
        )
        # a tile holds float32 similarities, their int32 column indices and a mask: ~12 bytes each
        redundancy = rkv_redundancy(inputs.keys, max_elements=c.rkv_score_chunk_mb * 2**20 // 12)[:, :scored]
        return c.rkv_alpha * importance - (1 - c.rkv_alpha) * redundancy
