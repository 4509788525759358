"""Ragged per-head kept sets as a ``Compaction`` (for the head-major store, ``StoreKind.HEAD_MAJOR``)."""

from __future__ import annotations

import torch


def ragged_rows(kept: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(keep, counts)`` for per-head kept sets ``kept`` ``[H, L]`` (bool): ``keep`` ``[H, n_max]`` holds
    each head's kept slots ascending, then padding (slot 0) up to the largest head's count; ``counts[h]``
    how many lead row ``h`` (``Compaction.head_counts``). One host read (the counts)."""
    num_slots = kept.shape[1]
    counts = kept.sum(1)
    width = int(counts.max()) if kept.numel() else 0
    # Kept slots sort first by their index, the others after every kept one.
    order = torch.where(
        kept, torch.arange(num_slots, device=kept.device), num_slots + torch.arange(num_slots, device=kept.device)
    )
    keep = torch.sort(order, dim=1).values[:, :width]
    keep = torch.where(keep < num_slots, keep, torch.zeros_like(keep))
    return keep, tuple(counts.tolist())
