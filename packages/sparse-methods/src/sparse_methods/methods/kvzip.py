"""KVzip: query-agnostic eviction by context reconstruction. Once the prompt is processed, the engine
runs replay passes (``replay_passes``): per chunk of ``kvzip_score_chunk_size`` prompt tokens, a
"repeat the context" instruction, the last ``kvzip_prev_postfix_size`` tokens of the previous chunk
(from the second chunk on), a newline and the chunk itself, teacher-forced against the request's KV.
A cached token's score is the most attention any replay query of its chunk pays it (max over the
queries and the KV group's heads, softmax over the sinks, the chunk and the replay's own tokens).
The ``L x H x layers`` scores are ranked together (``kvzip_layerwise``: per layer) and the best
``kvzip_token_budget`` per (layer, KV head) on average are kept; the first ``sink_keep_tokens``
always. Kept counts differ per layer and per KV head: it declares the head-major store
(``StoreKind.HEAD_MAJOR``), so each (layer, KV head) holds its own count (``Compaction.head_counts``)
and decode reads every slot each head holds. Each rank would hold different block counts: no tensor
parallelism with this store yet.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
(arXiv:2505.23416). kvpress's KVzipPress(compression_ratio=r, n_sink=4, chunk_size=2048) is
``kvzip_token_budget = L - int(L x H x layers x r) / (H x layers)`` with ``kvzip_prev_postfix_size=8``
on a model without a chat template (kvpress then ends the instruction with "\\n"; with a chat template
it uses the template's turn markers, which this method does not). SE's names and defaults
(``kvzip_token_budget=4096``, ``kvzip_score_chunk_size=2048``, ``kvzip_prev_postfix_size=64``); SE
keeps one token set shared by every layer and head, which is not offered here.

Cost: the replays process about the prompt again (each chunk plus ~20 instruction tokens), so
prefill costs ~2x; the memory plan holds the prompt plus the longest replay while scoring, then the
budget per (layer, KV head) on average: with the layers ranked together one layer may keep more than
another, but the sum over layers, which admission counts, holds. A request resuming a chain (its KV
already compacted) is not replayed.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from pydantic import Field

from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import (
    Category,
    Compaction,
    LayerAttention,
    MemoryPlan,
    MethodConfig,
    PrefixCacheMode,
    ReplayPass,
    RequestStep,
    SparseMethod,
    StepContext,
    Storage,
    StoreKind,
)
from sparse_methods.ragged_heads import ragged_rows
from sparse_methods.registry import register

FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
NEXT_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
INSTRUCTION_END = "\n"
MAX_INSTRUCTION_TOKENS = 64  # room the memory plan leaves for the instruction of one replay


class KVzipConfig(MethodConfig):
    kvzip_token_budget: int = Field(4096, ge=1, description="Prompt tokens kept per layer and KV head on average.")
    kvzip_score_chunk_size: int = Field(2048, ge=1, description="Prompt tokens reconstructed per replay pass.")
    kvzip_prev_postfix_size: int = Field(
        64, ge=0, description="Tokens of the previous chunk a replay starts from (its hint)."
    )
    kvzip_layerwise: bool = Field(False, description="Rank each layer on its own (else all layers together).")
    sink_keep_tokens: int = Field(4, ge=0, description="Leading tokens always kept, in tokens.")


def replay_probabilities(
    queries: torch.Tensor, candidates: torch.Tensor, scale: float, own: torch.Tensor | None = None
) -> torch.Tensor:
    """``[num_kv_heads, g, n, m (+ n)]``: each replay query's softmax attention over ``candidates``.

    ``queries`` ``[n, Hq, D]``; ``candidates`` ``[m, Hkv, D]`` keys before every query (all visible);
    ``own`` ``[n, Hkv, D]``: the replay's own keys, in the softmax too, causally (query ``i`` sees
    ``own[: i + 1]``), or None: the softmax is over the candidates only. Query heads ``h * g ..`` share KV
    head ``h``."""
    n, num_q_heads, d = queries.shape
    num_kv_heads = candidates.shape[1]
    g = num_q_heads // num_kv_heads
    keys = candidates if own is None else torch.cat([candidates, own])
    q = queries.float().view(n, num_kv_heads, g, d).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
    logits = torch.matmul(q, keys.float().permute(1, 2, 0).unsqueeze(1)) * scale  # [Hkv, g, n, m (+ n)]
    if own is not None:
        later = torch.ones(n, n, dtype=torch.bool, device=keys.device).triu(1)
        logits[..., candidates.shape[0] :].masked_fill_(later, float("-inf"))
    return torch.softmax(logits, dim=-1)


def replay_scores(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, *, start: int, end: int, sink: int
) -> torch.Tensor:
    """``[num_kv_heads, end - start]``: the most attention a replay pays each token of chunk ``[start, end)``.

    ``queries`` ``[n, Hq, D]`` are the replay's; ``keys`` ``[L + n, Hkv, D]`` the context then the
    replay's own. Softmax over the first ``min(sink, start)`` keys, the chunk and the replay (causal),
    max over the replay queries and each KV group's heads."""
    n = queries.shape[0]
    sink = min(sink, start)
    candidates = torch.cat([keys[:sink], keys[start:end]])
    probs = replay_probabilities(queries, candidates, scale, own=keys[keys.shape[0] - n :])
    return probs[..., sink : sink + end - start].amax(dim=(1, 2))


def replay_parts(context: Sequence[int], start: int, end: int, hint_start: int | None) -> tuple:
    """The ``ReplayPass.parts`` that reconstruct ``context[start:end]``: the first chunk's instruction
    when ``hint_start`` is None, else the next chunk's with ``context[hint_start:start]`` as its hint."""
    chunk = tuple(context[start:end])
    if hint_start is None:
        return (FIRST_INSTRUCTION, INSTRUCTION_END, chunk)
    return (NEXT_INSTRUCTION, tuple(context[hint_start:start]), INSTRUCTION_END, chunk)


class _Replay:
    """One request's reconstruction: chunk bounds and the scores gathered so far."""

    def __init__(self, chunks: list[tuple[int, int]], num_layers: int) -> None:
        self.chunks = chunks
        self.scores: list[torch.Tensor | None] = [None] * num_layers  # [Hkv, L] each
        self.done = 0


@register
class KVzip(SparseMethod):
    name = "kvzip"
    category = Category.PHYSICAL_EVICTION
    prefix_cache_mode = PrefixCacheMode.CHAIN
    Config = KVzipConfig
    storage = Storage(StoreKind.HEAD_MAJOR)  # ragged per-(layer, head) counts: memory is their sum
    # Not tensor parallel: ranks' heads would hold different block counts (one scheduler for all).

    def __init__(self, config, shape) -> None:
        super().__init__(config, shape)
        self._replays: dict[Hashable, _Replay] = {}
        self._fresh: set[Hashable] = set()  # requests whose prompt KV is untouched (slot = position)
        self._compacted: set[Hashable] = set()  # requests (and chains' next turns) whose KV it compacted
        self._step: dict[Hashable, int] = {}  # request -> replay pass index, this step

    def memory_plan(self, prompt_len: int, max_new_tokens: int, chunk_size: int) -> MemoryPlan:
        c = self.config
        kept = min(prompt_len, c.kvzip_token_budget)  # per (layer, KV head) on average
        replay = 0
        if prompt_len > c.kvzip_token_budget:
            replay = MAX_INSTRUCTION_TOKENS + c.kvzip_prev_postfix_size + min(prompt_len, c.kvzip_score_chunk_size)
        return MemoryPlan.uniform(self.shape.num_layers, prompt_len + replay, kept, kept + max_new_tokens)

    # -- the replay passes ---------------------------------------------------------------------------
    def prepare_step(self, step: StepContext) -> frozenset[Hashable]:
        self._step = {}
        for r in step.requests:
            if r.resumed_state:  # the chain's slots were compacted (what ``release`` returned)
                self._compacted.add(r.request_id)
            if r.replay is not None:
                self._step[r.request_id] = r.replay
            elif r.ends_prefill and r.kv_lens[0] == r.start and r.request_id not in self._compacted:
                self._fresh.add(r.request_id)  # nothing compacted before: slots = positions
        return frozenset(self._step)  # replay passes are observed

    def replay_passes(self, request_id: Hashable, prompt_token_ids: Sequence[int]) -> tuple[ReplayPass, ...]:
        c = self.config
        n = len(prompt_token_ids)
        fresh = request_id in self._fresh
        self._fresh.discard(request_id)  # asked once per prompt
        if not fresh or n <= c.kvzip_token_budget:
            return ()
        size = c.kvzip_score_chunk_size
        chunks = [(s, min(s + size, n)) for s in range(0, n, size)]
        self._replays[request_id] = _Replay(chunks, self.shape.num_layers)
        passes = []
        for i, (s, e) in enumerate(chunks):
            hint = None if i == 0 else max(chunks[i - 1][0], s - c.kvzip_prev_postfix_size)
            passes.append(ReplayPass(replay_parts(prompt_token_ids, s, e, hint)))
        return tuple(passes)

    def on_attention_end(self, layer: int, batch: LayerAttentionBatch) -> None:
        for request, view in batch:
            self._observe_replay(layer, request, view)

    def _observe_replay(self, layer: int, request: RequestStep, view: LayerAttention) -> None:
        state = self._replays[request.request_id]
        start, end = state.chunks[request.replay]
        context = view.keys.shape[0] - view.queries.shape[0]
        scores = replay_scores(
            view.queries, view.keys, view.scale, start=start, end=end, sink=self.config.sink_keep_tokens
        )
        if state.scores[layer] is None:
            state.scores[layer] = torch.zeros(self.shape.num_kv_heads, context, device=scores.device)
        state.scores[layer][:, start:end] = scores

    def finish_step(self) -> Mapping[Hashable, Compaction]:
        out = {}
        for rid, index in self._step.items():
            state = self._replays[rid]
            state.done = index + 1
            if state.done == len(state.chunks):
                out[rid] = self._compaction(rid, self._replays.pop(rid))
                self._compacted.add(rid)
        self._step = {}
        return out

    def _compaction(self, request_id: Hashable, state: _Replay) -> Compaction:
        """Every shard's heads ranked together; this shard keeps its heads' rows."""
        c = self.config
        reduction = self.head_reduction
        scores = reduction.gather(torch.stack(state.scores), 1)  # [layers, Hkv of every shard, L]
        scores[..., : c.sink_keep_tokens] = float("inf")
        layers, heads, length = scores.shape
        kept = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
        if c.kvzip_layerwise:
            per = heads * min(c.kvzip_token_budget, length)
            order = torch.sort(scores.view(layers, -1), dim=1, descending=True, stable=True).indices[:, :per]
            kept.view(layers, -1).scatter_(1, order, True)
        else:
            total = layers * heads * min(c.kvzip_token_budget, length)
            kept[torch.sort(scores.flatten(), descending=True, stable=True).indices[:total]] = True
        kept = kept.view(layers, heads, length)
        keep, counts = [], []
        for layer in range(layers):
            idx, n = ragged_rows(kept[layer])
            keep.append(reduction.local(idx, 0))
            counts.append(tuple(reduction.local(torch.tensor(n), 0).tolist()))
        return Compaction(tuple(keep), tuple(counts))

    # -- request events and chains -------------------------------------------------------------------
    def release(self, request_id: Hashable) -> object | None:
        self._replays.pop(request_id, None)
        self._fresh.discard(request_id)
        if request_id in self._compacted:
            self._compacted.discard(request_id)
            return True  # a later turn's slots are not positions
        return None
