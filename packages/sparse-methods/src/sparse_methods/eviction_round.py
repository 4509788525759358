"""A decode-time eviction round of one layer as one batch: the eviction base's fast path.

Mixed into ``EvictionMethod``. At a decode-time eviction every running request compacts at the same
step. When the engine gives a layer's observed decode rows as tensors (``LayerAttentionBatch.keys``,
the keys left in their pages) and the method keeps its decode queries in a ``QueryRing``, the requests
whose window is all in the ring compact together, per budget: their windows in one gather from the
ring (positions made once per step), one ``score_batch`` over the paged keys (SnapKV reads them in
place on a GPU), one ``keep_indices_batch``; no host sync. The others (and every request when
``observes_batched`` is False: the reference) go through their own view (``_observe_request``).
Each compaction names the round's tensor and its row (``Compaction.rows``), so the engine compacts a
layer's requests from that tensor in a few ops. A round that reads no query from the forward (every observed
request's window in the ring, ``EvictionMethod.observes_queries``) is handed over after the step's forward,
from the pool, so on a GPU its step replays the decode graph instead of running eagerly.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sparse_methods.attention_batch import LayerAttentionBatch, PagedKeys
from sparse_methods.deferred_selections import ScoreBatch
from sparse_methods.keep_rows import KeepRows
from sparse_methods.keep_selection import keep_indices_batch
from sparse_methods.scoring import MAX_SCORE_ELEMENTS


class BatchedRound:
    """The batched round (requires the ``EvictionMethod`` attributes it reads)."""

    observes_batched: bool = True
    """Compact a batched layer's decode rows together; False: each alone through its own view (the
    reference the batched path is tested against)."""

    def _batches_ring(self, batch: LayerAttentionBatch) -> bool:
        """The layer's compacting decode rows are scored as one batch from the ring and the paged keys."""
        return (
            batch.batched
            and self.observes_batched
            and self.query_ring is not None
            and self.batches_compactions
            and not self.accumulates
        )

    def _observe_batched(self, layer: int, batch: LayerAttentionBatch) -> list[int]:
        """Compact the batch's decode rows whose window is all in the ring (a full window pending) together:
        per budget, the windows in one gather from the ring, the keys in one gather from the pages, one
        ``score_batch`` and one ``keep_indices_batch`` (in chunks that bound the logits). Returns the
        indices of the other requests (observed one by one)."""
        w, ring, lens = self.observation_window, self.query_ring, batch.keys.kv_lens_cpu
        by_budget: dict[int, list[int]] = {}
        rest = []
        for i, r in enumerate(batch.requests):
            budgets = self._step[r.request_id][0]
            if (
                budgets is None
                or lens[i] <= budgets[layer]
                or r.request_id not in self._recorded
                or ring.num_pending(r.request_id) < w
            ):
                rest.append(i)
            else:
                by_budget.setdefault(budgets[layer], []).append(i)
        per_request = self.batch_elements_per_key(batch.keys)
        for budget, rows in by_budget.items():
            for chunk in _chunks(rows, [per_request * lens[i] for i in rows], MAX_SCORE_ELEMENTS):
                self._compact_batch(layer, batch, chunk, budget)
        return rest

    def batch_elements_per_key(self, keys: PagedKeys) -> int:
        """Float32 elements ``score_batch`` holds per key of a request over ``keys`` (the batch is cut to keep
        them within ``MAX_SCORE_ELEMENTS``): by default the window's logits."""
        return self.observation_window * self.shape.num_q_heads

    def _compact_batch(self, layer: int, batch: LayerAttentionBatch, rows: list[int], budget: int) -> None:
        rids = [batch.requests[i].request_id for i in rows]
        windows = self.query_ring.latest_batch(rids, layer)  # [B, w, Hq, D]
        keys = batch.keys.take(rows)
        scores = self.score_batch(layer, ScoreBatch.of_tensors(rids, windows, keys, batch.scale))
        sink, recent = self.protected(budget)
        keeps = keep_indices_batch(scores, keys.kv_lens, sink=sink, recent=recent, num_middle=budget - sink - recent)
        keeps = keeps.expand(-1, self.shape.num_kv_heads, -1)  # a shared row stays one (head stride 0)
        for row, (rid, window, keep) in enumerate(zip(rids, windows.unbind(0), keeps.unbind(0), strict=True)):
            self._states[rid].window[layer] = window
            self._pending.setdefault(rid, self._layers())[layer] = keep
            self._round_rows[rid, layer] = (keep, KeepRows(keeps, row))

    def _rows_of(self, request_id: Hashable, keep: list[torch.Tensor | None]) -> tuple[KeepRows | None, ...]:
        """``Compaction.rows`` of a request's pending ``keep``: per layer, the round's row when ``keep[l]`` is
        still the one the round gave (empty when no layer's is)."""
        rows = [self._round_rows.get((request_id, layer)) for layer in range(len(keep))]
        if not any(rows):
            return ()
        return tuple(r[1] if r is not None and r[0] is k else None for r, k in zip(rows, keep, strict=True))


def _chunks(rows: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """``rows`` in order, cut so that each piece's padded size (its count times its largest ``sizes``) stays
    within ``limit`` (a row alone may exceed it)."""
    out: list[list[int]] = [[]]
    widest = 0
    for row, size in zip(rows, sizes, strict=True):
        widest_then = max(widest, size)
        if out[-1] and widest_then * (len(out[-1]) + 1) > limit:
            out.append([])
            widest_then = size
        out[-1].append(row)
        widest = widest_then
    return out
