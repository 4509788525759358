"""Rows of a method's fixed device buffers, one per running request, and their per-step refill.

A buffer that a CUDA graph writes must keep its address, so per-request device state (a query ring,
running score sums) lives in rows of one tensor allocated up front: a request takes a row on its first
use and gives it back when it finishes, is aborted or is preempted. The per-step plan that says where
each batch row writes is copied into a fixed buffer too (``fill``).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class RequestRows:
    """Hands out ``num_rows`` rows, one per request (lowest free row first); ``what`` names them in errors."""

    def __init__(self, num_rows: int, what: str):
        self.num_rows = num_rows
        self.what = what
        self._free = list(range(num_rows - 1, -1, -1))  # a stack: pop() gives the lowest row
        self._rows: dict[Hashable, int] = {}

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._rows

    def __getitem__(self, request_id: Hashable) -> int:
        return self._rows[request_id]

    def take(self, request_id: Hashable) -> int:
        """The request's row, taking a free one on first use; an error when none is free."""
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                raise RuntimeError(f"no free {self.what} row for {request_id!r}: all {self.num_rows} rows are held")
            row = self._rows[request_id] = self._free.pop()
        return row

    def release(self, request_id: Hashable) -> None:
        """Give the request's row back (no-op when it holds none)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            self._free.sort(reverse=True)


def fill(buffer: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a step's plan into a fixed device buffer, stream-ordered after the steps queued before it: from
    a fresh pinned tensor each time (the previous step's copy may still be reading its own)."""
    if buffer.device.type == "cpu":
        buffer.copy_(host)
    else:
        buffer.copy_(host.pin_memory(), non_blocking=True)
