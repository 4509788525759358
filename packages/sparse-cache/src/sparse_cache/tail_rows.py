"""Tail rows: the per-request slots of a store's full-precision tail (KIVI's incomplete page).

A store whose pages are quantized as a whole keeps each running request's incomplete page outside
the pool, in one row of a fixed tail tensor. Rows belong to requests, not to a step's batch order:
a request takes a row the first time a step writes its KV and keeps it until it finishes, is
aborted or is preempted, so its partial page survives across chunks and decode steps.
"""

from __future__ import annotations

from collections.abc import Hashable


class TailRows:
    """Hands out ``num_rows`` rows, one per request (lowest free row first)."""

    def __init__(self, num_rows: int):
        if num_rows < 1:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))  # a stack: pop() gives the lowest row
        self._rows: dict[Hashable, int] = {}

    def row(self, request_id: Hashable) -> int:
        """The request's row, taking a free one on first use; an error when none is free."""
        row = self._rows.get(request_id)
        if row is not None:
            return row
        if not self._free:
            raise RuntimeError(f"no free tail row for request {request_id!r}: all {self.num_rows} rows are held")
        row = self._rows[request_id] = self._free.pop()
        return row

    def release(self, request_id: Hashable) -> None:
        """Give the request's row back (no-op when it holds none)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            self._free.sort(reverse=True)

    def held(self) -> dict[Hashable, int]:
        return dict(self._rows)

    @property
    def num_free(self) -> int:
        return len(self._free)
