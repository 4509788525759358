"""Running per-token attention sums of each decoding request, per layer, added inside the decode step.

An accumulating scorer (H2O) adds every decode query's attention probabilities to its tokens' scores.
On the host path that means handing each step's queries and every key to ``on_attention_end`` and
recomputing the softmax; here the decode kernel's own score output (``scores_out``: per KV head, the
probabilities of each listed token summed over the head's query group, in the step's CSR column
order) is added to fixed per-request rows on the device, so the steps between compactions run inside
CUDA graphs and never re-read keys outside the kernel.

The method plans each step on the host (``plan``: which decode rows add, their lengths), the engine
hands each full-attention layer's score output to ``add_decode`` (device only, graph-safe: fixed
buffers and shapes; rows that add nothing, a graph's padding included, and stale columns go to a
scratch area), and the method reads, compacts, loads and unloads a request's sums on the host path.
A request holds a row only while it decodes; its sums live in the method's state otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from sparse_methods.request_rows import RequestRows, fill


class DecodeScoreSums:
    """Sums ``[num_heads, capacity]`` per (decoding request, layer) for up to ``num_rows`` requests.

    ``sums[layer]``: float32 ``[num_heads, num_rows * capacity + 1]`` (the last column is scratch).
    ``scores``: float32 ``[num_kv_heads, max_columns]``, where the engine has the decode kernel write a
    layer's score output (the widest a step may hand over: its CSR columns, graph padding included).
    ``num_heads``: ``num_kv_heads`` (per-head sums) or 1 (summed over the KV heads).
    """

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        capacity: int,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
        max_batch_size: int,
        device: torch.device | str,
    ):
        if min(num_layers, num_rows, capacity, num_heads, num_kv_heads, block_size, max_batch_size) < 1:
            raise ValueError("decode score sums need positive sizes")
        if num_heads not in (1, num_kv_heads):
            raise ValueError(f"num_heads must be 1 or num_kv_heads ({num_kv_heads}), got {num_heads}")
        self.capacity = capacity
        self.block_size = block_size
        self.num_rows = num_rows
        pages = -(-capacity // block_size) + 1  # a row's pages, or a CUDA graph padding row's one
        self.max_columns = max_batch_size * pages * block_size
        self.scratch = num_rows * capacity
        width = self.scratch + 1
        self.sums = [torch.zeros(num_heads, width, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.scores = torch.zeros(num_kv_heads, self.max_columns, dtype=torch.float32, device=device)
        self._columns = torch.arange(self.max_columns, device=device)
        # per column: where it adds (scratch until the first plan: what graph captures add to)
        self._dest = torch.full((self.max_columns,), self.scratch, dtype=torch.int64, device=device)
        # per decode row: first column, length, row base (packed: one copy per step)
        self._rows_plan = torch.zeros(3, max_batch_size, dtype=torch.int64, device=device)
        self._rows = RequestRows(num_rows, "score-sum")
        self.lens: dict[Hashable, int] = {}  # each holder's tokens after the last planned step
        self._compacted: dict[Hashable, dict[int, int]] = {}  # since then, per layer: tokens kept by a compaction

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._rows

    def num_columns(self, kv_lens: Sequence[int]) -> int:
        """Score columns of a step whose decode rows hold ``kv_lens`` tokens (whole blocks each)."""
        return sum(-(-n // self.block_size) for n in kv_lens) * self.block_size

    def fits(self, kv_lens: Sequence[int]) -> bool:
        """Whether the decode kernel can hand over such a step's scores (else the method takes the host path)."""
        return self.num_columns(kv_lens) <= self.max_columns

    def plan(self, rows: Sequence[tuple[Hashable | None, int]]) -> None:
        """The next step's decode rows in order: ``(request id or None, the row's KV length after the step)``.
        A request id must hold a row (``load``); None adds nothing. One non-blocking copy."""
        if len(rows) > self._rows_plan.shape[1]:
            raise ValueError(f"{len(rows)} decode rows exceed the sums' {self._rows_plan.shape[1]}")
        host = torch.zeros(3, self._rows_plan.shape[1], dtype=torch.int64)
        host[0].fill_(self.max_columns)  # rows past the step's: never found by a column
        start = 0
        for i, (rid, kv_len) in enumerate(rows):
            host[0, i] = start
            start += -(-kv_len // self.block_size) * self.block_size
            if rid is None:
                host[2, i] = self.scratch
                continue
            if kv_len > self.capacity:
                raise ValueError(f"request {rid!r} holds {kv_len} tokens, over the sums' capacity {self.capacity}")
            host[1, i], host[2, i] = kv_len, self._rows[rid] * self.capacity
            self.lens[rid] = kv_len
            self._compacted.pop(rid, None)
        if start > self.max_columns:
            raise ValueError(f"the step's {start} score columns exceed {self.max_columns}")
        fill(self._rows_plan, host)
        self._plan_destinations()

    def _plan_destinations(self) -> None:
        """Each score column's destination: its row's sum, or the scratch area (device only, fixed shapes)."""
        starts, lens, bases = self._rows_plan
        row = torch.searchsorted(starts, self._columns, right=True).sub_(1).clamp_(min=0)
        offset = self._columns - starts[row]
        valid = (offset < lens[row]) & (offset >= 0)  # (no rows: every column lies before the "first")
        self._dest.copy_(bases[row].add_(offset).masked_fill_(~valid, self.scratch))

    def add_decode(self, layer: int) -> None:
        """Add the layer's decode score output (``scores``, summed over KV heads for one-row sums) to the
        planned rows (device only). Real destinations are distinct, so a gather, an add and a scatter do it
        without atomics (the scratch column takes whatever write lands last)."""
        sums = self.sums[layer]
        scores = self.scores if sums.shape[0] == self.scores.shape[0] else self.scores.sum(0, keepdim=True)
        sums[:, self._dest] = sums[:, self._dest] + scores

    def row(self, request_id: Hashable, layer: int) -> torch.Tensor:
        """``[num_heads, kv_len]``: a view of the request's sums over its current tokens."""
        base = self._rows[request_id] * self.capacity
        kv_len = self._compacted.get(request_id, {}).get(layer, self.lens[request_id])
        return self.sums[layer][:, base : base + kv_len]

    def load(self, request_id: Hashable, kv_len: int, sums: Sequence[torch.Tensor | None]) -> None:
        """Take a row for a request that starts decoding with ``kv_len`` tokens and per layer its sums so far
        (``[num_heads, n <= kv_len]``, the rest 0; None: all 0)."""
        row = self._rows.take(request_id)
        self.lens[request_id] = kv_len
        base = row * self.capacity
        for layer, s in enumerate(sums):
            span = self.sums[layer][:, base : base + self.capacity]
            span.zero_()
            if s is not None:
                span[:, : s.shape[1]] = s

    def compact(self, request_id: Hashable, layer: int, keep: torch.Tensor) -> None:
        """The request's sums follow a compaction: ``keep [num_heads, n]`` slots move to the front, the rest is 0."""
        base = self._rows[request_id] * self.capacity
        span = self.sums[layer][:, base : base + self.capacity]
        kept = torch.gather(span, 1, keep[: span.shape[0]])
        span.zero_()
        span[:, : keep.shape[1]] = kept
        self._compacted.setdefault(request_id, {})[layer] = keep.shape[1]

    def unload(self, request_id: Hashable) -> list[torch.Tensor]:
        """Give the row back; returns per layer a copy of the request's sums over its tokens."""
        out = [self.row(request_id, layer).clone() for layer in range(len(self.sums))]
        self.release(request_id)
        return out

    def release(self, request_id: Hashable) -> None:
        self.lens.pop(request_id, None)
        self._compacted.pop(request_id, None)
        self._rows.release(request_id)
