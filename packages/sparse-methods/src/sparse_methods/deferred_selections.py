"""The compactions of one layer that an evicting method scores together, and their batches.

At a decode-time eviction every running request compacts at the same step, so a layer hands the method
dozens of requests in a row. Instead of scoring and ranking each alone (a dozen small device ops and
index tensors per (request, layer)), the method keeps each request's ``ScoreInputs`` until the layer's
last one arrived, then scores and ranks them in batches (``ScoreBatch``): one per budget and window
length (PyramidKV's budgets depend on the prompt length), their keys padded to the longest. A batched
layer (``LayerAttentionBatch.keys``) needs no deferral: its ``ScoreBatch`` is made of the batch's tensors.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from sparse_methods.attention_batch import PagedKeys

if TYPE_CHECKING:
    from sparse_methods.eviction import ScoreInputs


class ScoreBatch:
    """``B`` requests' score inputs with equal window lengths ``n`` (and budgets), in one layer: either
    each request's ``ScoreInputs`` (``add``), or the batch's tensors (``of_tensors``: the window queries
    and the keys as ``PagedKeys``, gathered only when read)."""

    def __init__(self) -> None:
        self.request_ids: list[Hashable] = []
        self._inputs: list[ScoreInputs] = []
        self._queries: torch.Tensor | None = None
        self.paged: PagedKeys | None = None
        """The keys unread in their pages (a batch ``of_tensors``), for a scorer that reads them in place."""
        self._scale = 1.0

    @classmethod
    def of_tensors(
        cls, request_ids: list[Hashable], queries: torch.Tensor, keys: PagedKeys, scale: float
    ) -> ScoreBatch:
        """``queries``: ``[B, n, num_q_heads, D]`` each request's window (its last ``n`` slots)."""
        batch = cls()
        batch.request_ids, batch._queries, batch.paged, batch._scale = list(request_ids), queries, keys, scale
        return batch

    def add(self, request_id: Hashable, inputs: ScoreInputs) -> None:
        self.request_ids.append(request_id)
        self._inputs.append(inputs)

    @property
    def scale(self) -> float:
        return self._scale if self.paged is not None else self._inputs[0].scale

    @cached_property
    def queries(self) -> torch.Tensor:
        """``[B, n, num_q_heads, D]``."""
        return self._queries if self._queries is not None else torch.stack([i.queries for i in self._inputs])

    @cached_property
    def keys(self) -> torch.Tensor:
        """``[B, L, num_kv_heads, D]``, zeros past each request's ``kv_len`` (``L``: the longest)."""
        if self.paged is not None:
            return self.paged.dense()
        return pad_sequence([i.keys for i in self._inputs], batch_first=True)

    @property
    def kv_lens_cpu(self) -> tuple[int, ...]:
        if self.paged is not None:
            return self.paged.kv_lens_cpu
        return tuple(i.keys.shape[0] for i in self._inputs)

    @cached_property
    def kv_lens(self) -> torch.Tensor:
        """int64 ``[B]`` on the keys' device (copied without waiting for the device)."""
        if self.paged is not None:
            return self.paged.kv_lens
        host = torch.tensor(self.kv_lens_cpu, dtype=torch.int64)
        device = self._inputs[0].keys.device
        if device.type == "cpu":
            return host
        return host.pin_memory().to(device, non_blocking=True)

    @property
    def inputs(self) -> list[ScoreInputs]:
        """Each request's ``ScoreInputs`` as added (empty for a batch ``of_tensors``)."""
        return self._inputs


class DeferredSelections:
    """The layer's requests waiting to be scored, by (budget, window length)."""

    def __init__(self) -> None:
        self.layer = -1
        self.elements = 0  # logits their scoring computes (bounds the batch: see ``MAX_SCORE_ELEMENTS``)
        self._batches: dict[tuple[int, int], ScoreBatch] = {}

    def add(self, request_id: Hashable, inputs: ScoreInputs, budget: int) -> None:
        self._batches.setdefault((budget, inputs.queries.shape[0]), ScoreBatch()).add(request_id, inputs)
        self.elements += inputs.queries.shape[0] * inputs.queries.shape[1] * inputs.keys.shape[0]

    def batches(self) -> Iterator[tuple[int, ScoreBatch]]:
        """``(budget, batch)`` pairs."""
        for (budget, _), batch in self._batches.items():
            yield budget, batch
