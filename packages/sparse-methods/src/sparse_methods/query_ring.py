"""The latest decode queries of each running request, per layer, kept inside the decode step.

A method that scores tokens with a window of recent queries at its compactions (SnapKV's and R-KV's
decode-time eviction) needs every decode step's queries, but only at the steps that compact. A step
that merely remembers its queries would otherwise hand each request's queries and keys to the host
path (``on_attention_end``), which gathers keys and cannot run inside a CUDA graph. The ring keeps the
last ``window`` queries of each (request, layer) in fixed device buffers instead: the method plans
which decode rows record where (``plan``, on the host, before the forward), and every layer writes
its decode rows with one ``index_copy_`` from a fixed index buffer (``record``: device-only,
graph-safe; rows that record nothing, a CUDA graph's padding included, write a scratch row; the
engine may write them in its KV-store launch instead, from ``queries[layer]`` and ``dest``). At a
compaction the method reads a request's queries back in order (``latest``).

Rows belong to requests (taken on a request's first recorded step, given back by ``release``), not
to a step's batch order. Positions wrap: a request's ``n``-th recorded query since its row was taken
sits at ``n % window``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from sparse_methods.request_rows import RequestRows, fill


class QueryRing:
    """``window`` queries ``[num_heads, head_dim]`` per (request, layer) for up to ``num_rows`` requests.

    ``queries[layer]``: ``[num_rows * window + 1, num_heads, head_dim]`` (the last row is scratch);
    ``dest``: int64 ``[max_batch_size]``, where each decode row of the planned step writes.
    """

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        window: int,
        num_heads: int,
        head_dim: int,
        max_batch_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if min(num_layers, num_rows, window, num_heads, head_dim, max_batch_size) < 1:
            raise ValueError("a query ring needs positive sizes")
        self.window = window
        self.num_rows = num_rows
        self.scratch = num_rows * window
        shape = (num_rows * window + 1, num_heads, head_dim)
        self.queries = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.dest = torch.full((max_batch_size,), self.scratch, dtype=torch.int64, device=device)
        self._rows = RequestRows(num_rows, "query-ring")
        self._written: dict[Hashable, int] = {}  # queries written into the request's row since it was taken
        self._pending: dict[Hashable, int] = {}  # of those, written since the last ``clear``
        self._dest_used = False  # ``dest`` holds some row's position (else all scratch)
        self._positions: dict[tuple[Hashable, ...], torch.Tensor] = {}  # ``latest_batch``'s, this step

    def plan(self, request_ids: Sequence[Hashable | None]) -> None:
        """The next recorded step: its decode row ``i`` records a query of ``request_ids[i]`` (None:
        nothing). Host bookkeeping and one non-blocking copy into ``dest`` (stream-ordered after the
        steps queued before it)."""
        if len(request_ids) > self.dest.numel():
            raise ValueError(f"{len(request_ids)} decode rows exceed the ring's {self.dest.numel()}")
        self._positions = {}
        host = torch.full((self.dest.numel(),), self.scratch, dtype=torch.int64)
        recorded = any(rid is not None for rid in request_ids)
        if not recorded and not self._dest_used:
            return  # ``dest`` is all scratch already
        self._dest_used = recorded
        for i, rid in enumerate(request_ids):
            if rid is None:
                continue
            row = self._rows.take(rid)
            written = self._written.get(rid, 0)
            host[i] = row * self.window + written % self.window
            self._written[rid] = written + 1
            self._pending[rid] = self._pending.get(rid, 0) + 1
        fill(self.dest, host)

    def record(self, layer: int, queries: torch.Tensor) -> None:
        """Write a step's decode rows ``queries [n, num_heads, head_dim]`` where ``plan`` said (device only)."""
        self.queries[layer].index_copy_(0, self.dest[: queries.shape[0]], queries.to(self.queries[layer].dtype))

    def num_pending(self, request_id: Hashable) -> int:
        """Queries recorded for the request since its last ``clear`` (at most ``window`` of them are kept)."""
        return min(self._pending.get(request_id, 0), self.window)

    def latest(self, request_id: Hashable, layer: int) -> torch.Tensor:
        """``[num_pending, num_heads, head_dim]``: the request's queries recorded since its last ``clear``
        (the latest ``window`` of them), oldest first."""
        n = self.num_pending(request_id)
        if n == 0:
            return self.queries[layer][:0]
        row, written = self._rows[request_id], self._written[request_id]
        # made on the device from host scalars: a copy from pageable host memory would wait for the stream
        positions = torch.arange(written - n, written, device=self.dest.device).remainder_(self.window)
        return self.queries[layer][positions.add_(row * self.window)]

    def latest_batch(self, request_ids: Sequence[Hashable], layer: int) -> torch.Tensor:
        """``[B, window, num_heads, head_dim]``: ``latest`` of requests that each have a full window pending,
        in one gather. The positions are made once per step for the same requests (every layer's)."""
        key = tuple(request_ids)
        positions = self._positions.get(key)
        if positions is None:
            if any(self.num_pending(rid) < self.window for rid in key):
                raise ValueError("latest_batch needs a full window of queries pending for every request")
            rows = torch.tensor([self._rows[rid] * self.window for rid in key], dtype=torch.int64)
            written = torch.tensor([self._written[rid] for rid in key], dtype=torch.int64)
            host = (written.view(-1, 1) + torch.arange(-self.window, 0)).remainder_(self.window).add_(rows.view(-1, 1))
            positions = self._positions[key] = torch.empty_like(host, device=self.dest.device)
            fill(positions, host)
        return self.queries[layer][positions]

    def clear(self, request_id: Hashable) -> None:
        """Forget the request's recorded queries (it keeps its row)."""
        self._pending.pop(request_id, None)

    def release(self, request_id: Hashable) -> None:
        """Give the request's row back (no-op when it holds none)."""
        self._pending.pop(request_id, None)
        self._written.pop(request_id, None)
        self._rows.release(request_id)
