"""SkipKV: decode-time eviction for reasoning traces, importance minus token and segment redundancy.

Tian et al., "SkipKV: Selectively Skip KV Generation and Storage for Efficient Inference with Large
Reasoning Models" (arXiv:2512.07993), as the published SparseEngine runs it (without activation
steering). The prompt is never compressed. After a decode step, a layer holding ``kv_len`` slots with
``kv_len > B`` and ``kv_len >= B + skipkv_compression_interval`` (B = sink + keep + recent) is cut back
to B: its first ``sink_keep_tokens`` and last ``recent_keep_tokens`` slots stay, and the best
``decode_keep_tokens`` of the middle by

- importance: the step's query's attention over the candidates ``[sink, kv_len)`` (softmax of
  ``scale * q.k`` per query head), max over the heads: one kept set per layer, shared by its KV heads;
- minus, on the last ``skipkv_redundancy_window`` middle slots (the newest ones that can go),
  ``skipkv_alpha`` times the token redundancy (``token_redundancy``, the older R-KV formula);
- minus a sentence penalty (``skipkv_sentence_score_weight`` times the largest redundancy of a tracked
  sentence covering the token) when one exists, else the segment penalty on that window
  (``segment_penalty``).

Sentences are not tracked yet: SE embeds each generated sentence with the hidden state of layer
``skipkv_sentence_embedding_layer`` and cuts sentences at delimiter tokens, and the method contract
hands a method neither hidden states nor token ids. So no sentence penalty ever exists and the
segment penalty, SE's own fallback, always applies; the sentence parameters are kept (SE's names and
defaults) and validated. Activation steering (``skipkv_enable_activation_steering``) is not supported.

Read where SE's description leaves room: the redundancy window is the newest ``w`` middle slots (those
that can be evicted), and a token's "future" similar tokens are the later slots of that window.
Differences from SE: scores stay float32 (SE casts importance to the model dtype first), top-k ties go
to the earlier slot, and one GPU only (SE also runs it tensor-parallel).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field, model_validator

from sparse_methods.base import MethodConfig
from sparse_methods.eviction import EvictionMethod, Phase, ScoreInputs
from sparse_methods.registry import register

TOKEN_SIMILARITY_THRESHOLD = 0.8  # SE's rkv_similarity_threshold as resolved for skipkv
RECENT_SIMILAR_KEEP = 1  # SE's rkv_recent_similar_keep: a row's most recent similar future tokens not counted


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` flattened to ``[n, F]`` float32 rows of unit length."""
    flat = x.reshape(x.shape[0], -1).float()
    return flat / (flat.norm(dim=-1, keepdim=True) + 1e-8)


def token_redundancy(keys: torch.Tensor, *, threshold: float = TOKEN_SIMILARITY_THRESHOLD) -> torch.Tensor:
    """``[w]`` redundancy of each of ``w`` slots (``keys``: ``[w, num_kv_heads, D]``): cosine similarity
    ``S`` of the keys flattened over heads, diagonal zeroed, entries below ``threshold`` zeroed; in each
    row ``i`` the links to its ``RECENT_SIMILAR_KEEP`` most recent similar later slots zeroed (the newest
    near-copy does not count against ``i``); then the mean of each row, softmax over the slots."""
    w = keys.shape[0]
    unit = _unit_rows(keys)
    sim = unit @ unit.T
    sim.fill_diagonal_(0.0)
    similar = sim >= threshold
    sim = sim * similar
    cols = torch.arange(w, device=keys.device)
    later = similar & (cols.view(1, -1) > cols.view(-1, 1))
    rank = later.flip(-1).cumsum(-1).flip(-1)  # per row: similar later slots at or after each column
    sim = sim.masked_fill(later & (rank <= RECENT_SIMILAR_KEEP), 0.0)
    return torch.softmax(sim.mean(-1), dim=-1)


def segment_penalty(keys: torch.Tensor, *, segment_size: int, threshold: float) -> torch.Tensor:
    """``[w]`` penalty of each of ``w`` slots (``keys``: ``[w, num_kv_heads, D]``) cut into segments of
    ``segment_size`` (the last may be shorter): each segment's mean key (flattened over heads), normalised;
    a segment's largest cosine with any later segment if at least ``threshold`` (else 0), given to its slots."""
    w = keys.shape[0]
    segment = torch.arange(w, device=keys.device) // segment_size
    count = -(-w // segment_size)  # (from the shape: no device sync)
    flat = keys.reshape(w, -1).float()
    means = torch.zeros(count, flat.shape[1], device=keys.device).index_add_(0, segment, flat)
    means /= torch.bincount(segment, minlength=count).unsqueeze(1).float()
    unit = _unit_rows(means)
    sim = unit @ unit.T
    later = torch.ones(count, count, dtype=torch.bool, device=keys.device).triu(1)
    best = sim.masked_fill(~later, float("-inf")).amax(-1)  # the last segment: -inf, no penalty
    per_segment = torch.where(best >= threshold, best, torch.zeros_like(best))
    return per_segment[segment]


class SkipKVConfig(MethodConfig):
    sink_keep_tokens: int = Field(64, ge=0, description="Leading tokens always kept, in tokens.")
    decode_keep_tokens: int = Field(
        4096, ge=0, description="Tokens between sink and recent kept by score at each compaction, in tokens."
    )
    recent_keep_tokens: int = Field(512, ge=0, description="Most recent tokens always kept, in tokens.")
    skipkv_compression_interval: int = Field(
        128, ge=1, description="A layer is cut back to the budget once it holds the budget plus this many tokens."
    )
    skipkv_alpha: float = Field(
        0.1, ge=0.0, description="Weight of the token redundancy subtracted from importance on the redundancy window."
    )
    skipkv_similarity_threshold: float = Field(
        0.95, ge=-1.0, le=1.0, description="Cosine a segment's mean key needs with a later one to be penalised."
    )
    skipkv_segment_size: int = Field(32, ge=1, description="Tokens per segment of the segment penalty.")
    skipkv_max_redundancy_tokens: int = Field(
        4096, ge=1, description="Largest redundancy window accepted (its pairwise similarities grow as its square)."
    )
    skipkv_redundancy_window: int = Field(
        64, ge=0, description="Newest middle tokens (those that can go) that the redundancy penalties apply to."
    )
    skipkv_enable_sentence_scoring: bool = Field(
        True,
        description="Penalise tokens of sentences similar to earlier ones (no sentences are tracked yet: the "
        "segment penalty, SE's fallback, applies).",
    )
    skipkv_sentence_score_weight: float = Field(1.0, ge=0.0, description="Weight of the sentence penalty.")
    skipkv_sentence_min_tokens: int = Field(4, ge=1, description="Shorter sentences are not tracked.")
    skipkv_sentence_max_tokens: int = Field(256, ge=1, description="A sentence ends after this many tokens.")
    skipkv_sentence_embedding_layer: int = Field(
        -1, description="Layer whose hidden state embeds sentences (-1: the last)."
    )
    skipkv_max_tracked_sentences: int = Field(256, ge=1, description="Sentences remembered at most.")
    skipkv_enable_activation_steering: bool = Field(
        False, description="SE's activation steering on sentence delimiters: not supported (True is an error)."
    )

    @model_validator(mode="after")
    def _check(self):
        if self.skipkv_enable_activation_steering:
            raise ValueError("skipkv: activation steering (skipkv_enable_activation_steering=True) is not supported")
        if self.skipkv_redundancy_window > self.skipkv_max_redundancy_tokens:
            raise ValueError(
                f"skipkv_redundancy_window ({self.skipkv_redundancy_window}) exceeds "
                f"skipkv_max_redundancy_tokens ({self.skipkv_max_redundancy_tokens})"
            )
        if self.skipkv_sentence_min_tokens > self.skipkv_sentence_max_tokens:
            raise ValueError("skipkv_sentence_min_tokens must be <= skipkv_sentence_max_tokens")
        return self


@register
class SkipKV(EvictionMethod):
    name = "skipkv"
    aliases: ClassVar[tuple[str, ...]] = ("skip-kv", "skip_kv")
    Config = SkipKVConfig
    evicts_by_length = True  # a layer at budget + interval, checked after every decode step

    @property
    def _budget(self) -> int:
        c = self.config
        return c.sink_keep_tokens + c.decode_keep_tokens + c.recent_keep_tokens

    @property
    def _interval(self) -> int:
        return self.config.skipkv_compression_interval

    def budgets(self, prompt_len: int, phase: Phase) -> tuple[int, ...] | None:
        if phase is not Phase.DECODE:  # the prompt is never compressed
            return None
        return (self._budget,) * self.shape.num_layers

    @property
    def observation_window(self) -> int:
        return 1  # the step's query

    def score(self, layer: int, inputs: ScoreInputs) -> torch.Tensor:
        """``[1, kv_len - recent]``: importance of the middle slots minus the window's penalties (the sink's
        columns are not read)."""
        c = self.config
        keys, kv_len = inputs.keys, inputs.keys.shape[0]
        sink = min(c.sink_keep_tokens, kv_len)
        end = max(sink, kv_len - c.recent_keep_tokens)  # the middle is [sink, end)
        num_kv_heads = keys.shape[1]
        q = inputs.queries[-1].float().view(num_kv_heads, -1, keys.shape[2])  # [Hkv, g, D]: GQA groups
        logits = torch.einsum("hgd,lhd->hgl", q, keys[sink:].float()) * inputs.scale
        scores = torch.zeros(1, end, device=keys.device)
        scores[0, sink:] = torch.softmax(logits, dim=-1).amax((0, 1))[: end - sink]
        lo = max(sink, end - c.skipkv_redundancy_window)
        if end > lo:
            window = keys[lo:end]
            if c.skipkv_alpha > 0:
                scores[0, lo:end] -= c.skipkv_alpha * token_redundancy(window)
            scores[0, lo:end] -= segment_penalty(
                window, segment_size=c.skipkv_segment_size, threshold=c.skipkv_similarity_threshold
            )
        return scores
