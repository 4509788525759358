"""Ragged per-head kept sets in a store that gives every KV head of a layer the same slots.

A method that keeps a different number of tokens per KV head (AdaKV, KVzip) compacts each layer to
the largest head's count: a head with fewer tokens keeps its own tokens plus filler slots (its
next-best ones), and ``HeadMasks`` remembers which compacted slots each head owns, so that decode
reads only those (per-head slot lists, ``Selection`` rows padded with -1). Memory per layer is the
largest head x the heads, not the sum of the heads' counts.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sparse_methods.base import DENSE_LAYER, DecodeRead, HeadReduction, LayerPlan, Selection, Unit


def ragged_keep(kept: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, valid)`` ``[H, n_max]`` for per-head kept sets ``kept`` ``[H, L]`` (bool): each row holds
    its head's kept slots and, up to the largest head's count, its best-``rank``ed other slots as
    fillers (``valid`` False there), ascending."""
    n_max = int(kept.sum(1).max())
    order = torch.where(kept, torch.full_like(rank, float("inf")), rank.float())
    keep = torch.sort(torch.sort(order, dim=1, descending=True, stable=True).indices[:, :n_max], dim=1).values
    return keep, torch.gather(kept, 1, keep)


_PER_HEAD = LayerPlan(DecodeRead.PER_REQUEST, unit=Unit.SLOT)


class HeadMasks:
    """Per (request, layer), which compacted slots each KV head owns (None: all of them)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._valid: dict[Hashable, list[torch.Tensor | None]] = {}

    def set(
        self, request_id: Hashable, layer: int, valid: torch.Tensor, reduction: HeadReduction | None = None
    ) -> None:
        """``valid`` ``[H, n]``: the layer was compacted to ``n`` slots; head ``h`` owns ``valid[h]``.

        ``reduction``: ``valid`` holds every shard's heads (``HeadReduction.gather``); this shard keeps
        its rows, and every shard stores None (nothing to select) only when every head owns every slot,
        so that all ranks select in the same layers."""
        layers = self._valid.setdefault(request_id, [None] * self.num_layers)
        own = valid if reduction is None else reduction.local(valid, 0)
        layers[layer] = None if bool(valid.all()) else own

    def layer_plan(self, layer: int) -> LayerPlan:
        """Per-request slot lists (``selection``) in a layer where some request's heads own different slots."""
        if any(v[layer] is not None for v in self._valid.values()):
            return _PER_HEAD
        return DENSE_LAYER

    def head_slots(self, request_id: Hashable, layer: int, kv_len: int) -> list[torch.Tensor] | None:
        """Per KV head, the slots ``0 .. kv_len-1`` it attends to (its own compacted ones, then every
        later slot), or None when every head attends to every slot."""
        valid = self._valid.get(request_id, [None] * self.num_layers)[layer]
        if valid is None:
            return None
        after = torch.arange(valid.shape[1], kv_len, device=valid.device)
        return [torch.cat([row.nonzero().flatten(), after]) for row in valid]

    def selection(self, request_id: Hashable, layer: int, kv_len: int) -> Selection | None:
        """The decode selection reading each head's own slots (rows lead with -1 to a common width)."""
        rows = self.head_slots(request_id, layer, kv_len)
        if rows is None:
            return None
        width = max(r.numel() for r in rows)
        padded = torch.full((len(rows), width), -1, dtype=torch.int64)
        for h, row in enumerate(rows):
            padded[h, width - row.numel() :] = row.cpu()
        return Selection(padded, page_size=1)

    def pop(self, request_id: Hashable) -> list[torch.Tensor | None] | None:
        return self._valid.pop(request_id, None)

    def restore(self, request_id: Hashable, layers: list[torch.Tensor | None]) -> None:
        self._valid[request_id] = list(layers)
