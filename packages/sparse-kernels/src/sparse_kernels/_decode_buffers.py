"""Persistent device buffers of the Triton decode: step metadata and split-K scratch.

A CUDA graph records buffer addresses, so ``plan`` copies each step's CSR into these tensors instead of
allocating new ones. Capacities are fixed up front when the caller passes ``max_batch_size`` /
``max_num_pages``; otherwise a buffer grows (to at least twice its size) when a plan needs more, which
moves it and so invalidates graphs captured before.
"""

from __future__ import annotations

import functools

import torch

from sparse_kernels._backend import copy_host_into

# Split-K sizing: aim for this many programs per SM (decode is bandwidth-bound; several resident
# programs per SM hide load latency), with at most MAX_SPLITS chunks per (request, KV head). 8 was the
# best setting for both batch 1 and 32 at 32K context on an H200 (benchmarks/NOTES.md).
PROGRAMS_PER_SM = 8
MAX_SPLITS = 64


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 2 on CPU, which keeps interpreter grids small yet split."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def choose_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per list: a function of the batch size only (for a given model and GPU), so a graph
    captured for one batch size replays for any step of that size."""
    target = PROGRAMS_PER_SM * num_sms(device)
    return max(1, min(MAX_SPLITS, -(-target // (batch * num_kv_heads))))


class DecodeBuffers:
    """``indptr``/``indices``/``last_len`` (int32, copied in by ``load``) plus the split-K scratch.

    Parameters
    ----------
    device : torch.device
    max_batch_size : int, optional
        Fixes the list capacity at ``max_batch_size * num_kv_heads`` lists (head-sparse plans have one
        list per (request, KV head)) and sizes the scratch for any batch up to it.
    max_num_pages : int, optional
        Fixes the capacity of ``kv_indices`` (entries: block ids, or slot ids when ``page_size == 1``).
    num_splits : int, optional
        Fixed split count instead of ``choose_num_splits``.
    """

    def __init__(
        self, device: torch.device, max_batch_size: int | None, max_num_pages: int | None, num_splits: int | None
    ):
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("max_num_pages", max_num_pages),
            ("num_splits", num_splits),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_num_pages = max_num_pages
        self.forced_splits = num_splits
        self.indptr = self._int32(0)
        self.indices = self._int32(0)
        self.last_len = self._int32(0)
        self.o_part = torch.empty(0, device=device)  # float32 [rows * BLOCK_D]
        self.lse_part = torch.empty(0, device=device)  # float32 [rows], base-2 log-sum-exp per split
        self.lse = torch.empty(0, device=device)  # float32 [batch * num_qo_heads], final, base 2

    def load(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_len: torch.Tensor, num_kv_heads: int):
        """Copy one step's CSR (validated host int32 tensors) into the persistent buffers."""
        list_cap = None if self.max_batch_size is None else self.max_batch_size * num_kv_heads
        self.indptr = self._fit(
            self.indptr, kv_indptr.numel(), None if list_cap is None else list_cap + 1, "kv_indptr entries"
        )
        self.last_len = self._fit(self.last_len, kv_last_len.numel(), list_cap, "lists")
        self.indices = self._fit(self.indices, kv_indices.numel(), self.max_num_pages, "kv_indices entries")
        copy_host_into(self.indptr, kv_indptr)
        copy_host_into(self.indices, kv_indices)
        copy_host_into(self.last_len, kv_last_len)

    def reserve_scratch(self, batch: int, num_qo_heads: int, num_kv_heads: int, block_d: int) -> None:
        """Size the split-K scratch for ``batch`` (or for every batch up to ``max_batch_size``)."""
        sizes = range(1, self.max_batch_size + 1) if self.max_batch_size is not None else (batch,)
        rows = max(b * num_qo_heads * self.num_splits(b, num_kv_heads) for b in sizes)
        lse_rows = max(sizes) * num_qo_heads
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(f"batch {batch} exceeds the fixed capacity max_batch_size={self.max_batch_size}")
        if self.o_part.numel() < rows * block_d:
            self.o_part = torch.empty(_grown(self.o_part.numel(), rows * block_d), device=self.device)
        if self.lse_part.numel() < rows:
            self.lse_part = torch.empty(_grown(self.lse_part.numel(), rows), device=self.device)
        if self.lse.numel() < lse_rows:
            self.lse = torch.empty(_grown(self.lse.numel(), lse_rows), device=self.device)

    def num_splits(self, batch: int, num_kv_heads: int) -> int:
        return self.forced_splits or choose_num_splits(batch, num_kv_heads, self.device)

    def _int32(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)

    def _fit(self, buf: torch.Tensor, needed: int, capacity: int | None, what: str) -> torch.Tensor:
        if capacity is not None:
            if needed > capacity:
                raise ValueError(f"plan needs {needed} {what} but the fixed capacity is {capacity}")
            return buf if buf.numel() >= capacity else self._int32(capacity)
        return buf if buf.numel() >= needed else self._int32(_grown(buf.numel(), needed))


def _grown(current: int, needed: int) -> int:
    return max(needed, 2 * current)
