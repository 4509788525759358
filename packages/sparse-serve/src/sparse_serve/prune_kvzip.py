"""Prune policy ``kvzip_global``: range tokens scored by how much a reconstruction of them attends to them.

For each range ``[L, R)`` and each chunk ``[s, e)`` of it (``kvzip_score_chunk_size`` tokens), a
scratch forward runs the cached history up to the last range's end ``R_max``, then KVzip's replay of
the chunk (``sparse_methods.methods.kvzip.replay_parts``: its "repeat the context" instruction, the
``kvzip_prev_postfix_size`` tokens before the chunk, clamped to ``L``, as a hint, and the chunk). A
replay query's attention is a softmax over the range's keys only; per layer a token scores the mean
over the replay's queries, max over query heads; its score is the max over layers and chunks. The
``keep_tokens`` best over all ranges together are kept (one budget, ties to the earlier position),
one set for every layer and head: SE's token-shared variant of KVzip (Kim et al., arXiv:2505.23416),
not the paper's per-head eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sparse_cache import PruneRange
from sparse_methods import LayerAttention, ModelShape, RequestStep
from sparse_methods.methods.kvzip import replay_parts, replay_probabilities
from sparse_methods.scoring import MAX_SCORE_ELEMENTS
from sparse_serve.prune_scratch import ScratchScorer


class _ReplayScorer(ScratchScorer):
    """Sums, per layer, each query head's softmax over the ``target`` keys of the queries at positions
    from ``first_query`` on (the replay's), and counts those queries."""

    def __init__(self, shape: ModelShape, target: PruneRange, first_query: int):
        super().__init__(shape)
        self.target, self.first_query = target, first_query
        self.sums: list[torch.Tensor | None] = [None] * shape.num_layers  # [Hq, len(target)] each
        self.counts = [0] * shape.num_layers

    def observe(self, layer: int, step: RequestStep, view: LayerAttention) -> None:
        lo = max(self.first_query, step.start)
        if lo >= step.end:
            return
        q = view.queries[lo - step.start :]  # [n, Hq, D]
        candidates = view.keys[self.target.start : self.target.end]  # the scratch table is exact: slot = position
        total = self.sums[layer]
        if total is None:
            total = torch.zeros(q.shape[1], len(self.target), device=q.device)
        rows = max(1, MAX_SCORE_ELEMENTS // (q.shape[1] * len(self.target)))
        for a in range(0, q.shape[0], rows):
            total += replay_probabilities(q[a : a + rows], candidates, view.scale).sum(2).flatten(0, 1)
        self.sums[layer] = total
        self.counts[layer] += q.shape[0]

    def scores(self) -> torch.Tensor:
        """``[len(target)]`` on the host: the mean over replay queries, max over query heads and layers."""
        per_layer = [(s / n).amax(0) for s, n in zip(self.sums, self.counts, strict=True)]
        return torch.stack(per_layer).amax(0).cpu()


def kvzip_global_scores(
    shape: ModelShape,
    token_ids: Sequence[int],
    ranges: Sequence[PruneRange],
    encode: Callable[[str], list[int]],
    forward: Callable[[list[int], ScratchScorer], None],
    *,
    chunk_size: int,
    prev_size: int,
) -> list[torch.Tensor]:
    """``[len(r)]`` scores of each range ``r`` (ascending, inside ``token_ids``). ``encode`` tokenizes the
    instruction (no special tokens); ``forward(ids, scorer)`` runs a scratch forward of ``ids``, a
    history prefix then a replay, over the cached history."""
    r_max = ranges[-1].end
    out = []
    for r in ranges:
        best = torch.zeros(len(r))
        for s in range(r.start, r.end, chunk_size):
            hint = None if s == r.start else max(r.start, s - prev_size)
            parts = replay_parts(token_ids, s, min(s + chunk_size, r.end), hint)
            replay = [i for part in parts for i in (encode(part) if isinstance(part, str) else part)]
            scorer = _ReplayScorer(shape, r, r_max)
            forward([*token_ids[:r_max], *replay], scorer)
            best = torch.maximum(best, scorer.scores())
        out.append(best)
    return out


def top_over_ranges(scores: Sequence[torch.Tensor], ranges: Sequence[PruneRange], keep: int) -> list[list[int]]:
    """The ``keep`` best-scored positions of all ``ranges`` together (ties go to the earlier position),
    as each range's ascending positions."""
    positions = torch.cat([torch.arange(r.start, r.end) for r in ranges])  # ascending: ranges are
    order = torch.sort(torch.cat(list(scores)), descending=True, stable=True).indices[:keep]
    chosen = sorted(positions[order].tolist())
    return [[p for p in chosen if r.start <= p < r.end] for r in ranges]
