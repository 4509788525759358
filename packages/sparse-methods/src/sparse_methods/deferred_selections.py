"""The compactions of one layer that an evicting method scores together, and their batches.

At a decode-time eviction every running request compacts at the same step, so a layer hands the method
dozens of requests in a row. Instead of scoring and ranking each alone (a dozen small device ops and
index tensors per (request, layer)), the method keeps each request's ``ScoreInputs`` until the layer's
last one arrived, then scores and ranks them in batches (``ScoreBatch``): one per budget and window
length (PyramidKV's budgets depend on the prompt length), their keys padded to the longest.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

if TYPE_CHECKING:
    from sparse_methods.eviction import ScoreInputs


@dataclass
class ScoreBatch:
    """``B`` requests' ``ScoreInputs`` with equal window lengths ``n`` (and budgets), in one layer."""

    request_ids: list[Hashable] = field(default_factory=list)
    inputs: list[ScoreInputs] = field(default_factory=list)

    @property
    def scale(self) -> float:
        return self.inputs[0].scale

    @cached_property
    def queries(self) -> torch.Tensor:
        """``[B, n, num_q_heads, D]``."""
        return torch.stack([i.queries for i in self.inputs])

    @cached_property
    def keys(self) -> torch.Tensor:
        """``[B, L, num_kv_heads, D]``, zeros past each request's ``kv_len`` (``L``: the longest)."""
        return pad_sequence([i.keys for i in self.inputs], batch_first=True)

    @cached_property
    def kv_lens(self) -> torch.Tensor:
        """int64 ``[B]`` on the keys' device (copied without waiting for the device)."""
        host = torch.tensor([i.keys.shape[0] for i in self.inputs], dtype=torch.int64)
        device = self.inputs[0].keys.device
        if device.type == "cpu":
            return host
        return host.pin_memory().to(device, non_blocking=True)


class DeferredSelections:
    """The layer's requests waiting to be scored, by (budget, window length)."""

    def __init__(self) -> None:
        self.layer = -1
        self.elements = 0  # logits their scoring computes (bounds the batch: see ``MAX_SCORE_ELEMENTS``)
        self._batches: dict[tuple[int, int], ScoreBatch] = {}

    def add(self, request_id: Hashable, inputs: ScoreInputs, budget: int) -> None:
        batch = self._batches.setdefault((budget, inputs.queries.shape[0]), ScoreBatch())
        batch.request_ids.append(request_id)
        batch.inputs.append(inputs)
        self.elements += inputs.queries.shape[0] * inputs.queries.shape[1] * inputs.keys.shape[0]

    def batches(self) -> Iterator[tuple[int, ScoreBatch]]:
        """``(budget, batch)`` pairs."""
        for (budget, _), batch in self._batches.items():
            yield budget, batch
