"""Shared machinery of physical-eviction methods: per-step request records and pending compactions.

Subclasses decide, per layer and request, which slots to keep (``self.evict(...)``) from inside
``on_attention_end``; ``finish_step`` hands the engine every decision of the step at once.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping

import torch

from sparse_methods.base import Compaction, RequestStep, SparseMethod, StepContext


class EvictionMethod(SparseMethod):
    """Base of the physical-eviction family (KV of dropped tokens is freed, positions unchanged)."""

    def prepare_step(self, step: StepContext) -> None:
        self._step = {r.request_id: r for r in step.requests}
        self._pending: dict[Hashable, list[torch.Tensor | None]] = {}
        self._wanted = self.select_requests(step)

    def select_requests(self, step: StepContext) -> dict[int, set[Hashable]]:
        """Layer -> requests whose attention inputs the method needs this step (default: none)."""
        return {}

    def attention_requests(self, layer: int) -> Collection[Hashable]:
        return self._wanted.get(layer, ())

    def evict(self, request_id: Hashable, layer: int, keep: torch.Tensor) -> None:
        """Record ``keep`` (``[num_kv_heads, n]`` ascending slot indices) for one layer of a request."""
        if keep.dim() != 2 or keep.shape[0] != self.shape.num_kv_heads:
            raise ValueError(f"keep must be [num_kv_heads={self.shape.num_kv_heads}, n]; got {tuple(keep.shape)}")
        pending = self._pending.setdefault(request_id, [None] * self.shape.num_layers)
        pending[layer] = keep

    def finish_step(self) -> Mapping[Hashable, Compaction]:
        out = {rid: Compaction(tuple(keep)) for rid, keep in self._pending.items()}
        self._pending = {}
        return out

    def kv_len_after(self, request: RequestStep, layer: int) -> int:
        return request.kv_lens[layer] + request.num_new_tokens


def all_layers(num_layers: int, requests: Collection[Hashable]) -> dict[int, set[Hashable]]:
    ids = set(requests)
    return {layer: ids for layer in range(num_layers)} if ids else {}
