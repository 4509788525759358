"""The eviction family's observation on the device: decode queries in a ring, decode scores in sums.

Mixed into ``EvictionMethod``: the step's decode rows (its leading single-token rows) leave what the
method scores with on the device, written inside the step by the engine (graph-safe), instead of
handing every step's queries and keys to ``on_attention_end``:

- a window scorer (SnapKV, PyramidKV, R-KV, TOVA) gets ``QueryRing``: its recent decode queries, folded
  into the request's window at the compacting step (or into a chain's snapshot);
- an accumulating scorer (H2O) gets ``DecodeScoreSums``: the decode kernel's per-token probabilities
  added to running sums, which hold a request's scores while it decodes (loaded from its state at its
  first decode step, given back at a step that is not a decode) and follow its compactions.

Without them (latent or quantized stores, per-layer tables, tensor-parallel shared scores) every
method keeps the host path.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sparse_methods.base import RequestStep


class DeviceObservation:
    """Planning and host-side reading of an evicting method's device state (``query_ring`` or
    ``decode_score_sums``, set by the engine). Requires the ``EvictionMethod`` attributes it reads."""

    _recorded: frozenset[Hashable] = frozenset()  # requests whose decode query stays on the device this step

    def _plan_device(self, requests: tuple[RequestStep, ...]) -> frozenset[Hashable]:
        """Plan what the step's decode rows (its leading single-token rows) leave on the device: queries in
        the ring, or scores in the sums. Returns the requests whose decode query is taken there."""
        rows = []
        for r in requests:
            if r.num_new_tokens != 1:
                break  # the decode rows come first
            rows.append((r.request_id if r.is_decode else None, max(r.kv_lens) + 1))
        sums = self.decode_score_sums
        if self.query_ring is not None:
            self.query_ring.plan([rid for rid, _ in rows])
        elif sums is not None:
            if not sums.fits([n for _, n in rows]):  # too wide for its scores buffer (a long prompt's last
                rows = []  # token beside the decodes): this step's decodes take the host path
            self._plan_score_sums(rows, {r.request_id for r in requests})
        else:
            return frozenset()
        self._recorded = frozenset(rid for rid, _ in rows if rid is not None)
        return self._recorded

    def _plan_score_sums(self, rows: list[tuple[Hashable | None, int]], stepping: set[Hashable]) -> None:
        """A request's scores live in the sums while it decodes (loaded from its state at its first decode
        step) and go back to its state at a step that is not a decode (a turn's new prompt)."""
        sums = self.decode_score_sums
        decoding = {rid for rid, _ in rows if rid is not None}
        for rid in stepping - decoding:
            if rid in sums:
                self._states[rid].scores = self._unload_scores(rid)
        for rid, kv_len in rows:
            if rid is not None and rid not in sums:
                state = self._states[rid]
                sums.load(rid, kv_len - 1, state.scores)
                state.scores = self._layers()
        sums.plan(rows)

    def _unload_scores(self, request_id: Hashable) -> list[torch.Tensor | None]:
        scores = self.decode_score_sums.unload(request_id)
        return [None if layer in self.shape.windowed_layers else s for layer, s in enumerate(scores)]

    def _forget_window(self, request_id: Hashable, state) -> None:
        """Unobserved tokens arrive: the queries observed so far are no longer those of the last slots."""
        state.window = self._layers()
        if self.query_ring is not None:
            self.query_ring.clear(request_id)

    def _folded_windows(self, request_id: Hashable, state) -> list[torch.Tensor | None]:
        """The request's windows with the queries the ring kept since the last fold appended."""
        ring = self.query_ring
        if ring is None or not ring.num_pending(request_id):
            return list(state.window)
        windows = []
        for layer, prev in enumerate(state.window):
            if layer in self.shape.windowed_layers:  # never observed nor recorded
                windows.append(prev)
                continue
            queries = ring.latest(request_id, layer)
            windows.append((queries if prev is None else torch.cat([prev, queries]))[-self.observation_window :])
        return windows

    def _saved_scores(self, request_id: Hashable, state) -> list[torch.Tensor | None]:
        """The request's running scores for a snapshot: copies out of the sums while it decodes."""
        sums = self.decode_score_sums
        if sums is None or request_id not in sums:
            return list(state.scores)
        return [
            None if layer in self.shape.windowed_layers else sums.row(request_id, layer).clone()
            for layer in range(self.shape.num_layers)
        ]
