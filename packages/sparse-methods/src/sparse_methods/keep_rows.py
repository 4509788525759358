"""Where a request's kept indices of one layer came from: a row of a batched round's tensor.

A decode-time eviction round ranks a layer's compacting requests together and gets their kept indices
as one ``[B, num_kv_heads, n]`` device tensor; each request's ``Compaction.keep[l]`` is its row (a view).
``KeepRows`` names that tensor and the row, so the engine can hand a layer's rows of many requests to
``compact_kv`` with a few tensor ops for the whole batch instead of one per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, eq=False)
class KeepRows:
    """Row ``row`` of ``batch`` (``[B, num_kv_heads, n]``) is the request's ``keep[l]``."""

    batch: torch.Tensor
    row: int
