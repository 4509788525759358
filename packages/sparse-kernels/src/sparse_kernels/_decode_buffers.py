"""Persistent device buffers of the Triton decode: step metadata and split-K scratch.

A CUDA graph records buffer addresses, so ``plan`` copies each step's CSR into these tensors instead of
allocating new ones. Capacities are fixed up front when the caller passes ``max_batch_size`` /
``max_num_pages``; otherwise the buffers grow (to at least twice their size) when a plan needs more,
which moves them and so invalidates graphs captured before.

The three CSR arrays (and KIVI's per-request tail rows, ``tail_index``) are views of one device tensor,
filled from one persistent pinned staging tensor
of the same layout by a single non-blocking copy per plan (instead of a pinned allocation and a copy
per array); before the staging tensor is rewritten, the host waits for the previous copy out of it.
"""

from __future__ import annotations

import functools

import torch

# Split-K sizing: aim for this many programs per SM (decode is bandwidth-bound; several resident
# programs per SM hide load latency), with at most MAX_SPLITS chunks per (request, KV head). When the lists
# alone give every SM a program (large batches of evicted 8K contexts), PROGRAMS_PER_SM_MANY_LISTS:
# finer splits balance the last wave (H200, 91 lists of 8448 tokens x 8 heads: 2 splits 92.8% of copy
# bandwidth, 6 splits 102.0%; short lists at small batches lose with them, e.g. 5 x 2048: 17.1 -> 19.4 us).
# Fewer lists than SMs: PROGRAMS_PER_SM for bf16 KV. 8 was the best at batch 1 and 32 at 32K (session 4;
# batch 1 reaches MAX_SPLITS at 4 or 8 alike); at batch 5 on an H200 (session 14, 40 lists) 4 beat 8 in
# a whole decode step (128K: 27.42 -> 26.90 ms; 8K: 6.13 -> 6.05) and in the engine (dense 27.41 -> 27.10
# ms, SnapKV-8192 over its whole 2K decode 6.33 -> 6.20, Quest-2048's median 8.07 -> 7.96). Quantized KV
# aims at QUANTIZED_WARPS_PER_SM resident warps: 8 programs of 4 warps (fp8 at batch 16 ran 1.80 ms per
# layer at 8, 1.93 at 4; session 5), 32 of KIVI's one-warp programs (KIVI-4 at batch 16 x 128K, one
# layer: 4.07 ms at 8 one-warp programs per SM, 2.82 at 32; session 16).
PROGRAMS_PER_SM = 4
QUANTIZED_WARPS_PER_SM = 32
PROGRAMS_PER_SM_MANY_LISTS = 32
MAX_SPLITS = 64


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 2 on CPU, which keeps interpreter grids small yet split."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    device: torch.device,
    quantized: bool = False,
    program_warps: int = 4,
    warps_per_sm: int | None = None,
) -> int:
    """Splits per list: a function of the batch size only (for a given model, GPU, KV store and launch
    config), so a graph captured for one batch size replays for any step of that size. ``quantized``:
    the quantized kernel's programs of ``program_warps`` warps, aiming at ``warps_per_sm`` resident warps
    (default ``QUANTIZED_WARPS_PER_SM``; a scheme's launch config may set its own)."""
    lists, sms = batch * num_kv_heads, num_sms(device)
    per_sm = QUANTIZED_WARPS_PER_SM if warps_per_sm is None else warps_per_sm
    few = max(1, per_sm // program_warps) if quantized else PROGRAMS_PER_SM
    target = (PROGRAMS_PER_SM_MANY_LISTS if lists >= sms else few) * sms
    return max(1, min(MAX_SPLITS, -(-target // lists)))


class DecodeBuffers:
    """``indptr``/``indices``/``last_len``/``tail_index`` (int32, copied in by ``load``) plus the split-K scratch.

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
        self._caps = (0, 0, 0, 0)  # entries of indptr, last_len, indices, tail_index in the packed buffer
        self._packed = self._staging = self._int32(0)
        self.indptr = self.last_len = self.indices = self.tail_index = self._packed
        self._copied: torch.cuda.Event | None = None  # the last copy out of the staging tensor
        self._scratch_key: tuple | None = None
        self.o_part = torch.empty(0, device=device)  # float32 [rows * BLOCK_D]
        self.lse_part = torch.empty(0, device=device)  # float32 [rows], base-2 log-sum-exp per split
        self.lse = torch.empty(0, device=device)  # float32 [batch * num_qo_heads], final, base 2

    def load(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_len: torch.Tensor,
        num_kv_heads: int,
        tail_index: torch.Tensor | None = None,
    ):
        """Copy one step's CSR (validated host int32 tensors; ``tail_index`` ``[B]`` or None) into the buffers."""
        list_cap = None if self.max_batch_size is None else self.max_batch_size * num_kv_heads
        tails = torch.zeros(0, dtype=torch.int32) if tail_index is None else tail_index
        caps = (
            _capacity(kv_indptr.numel(), None if list_cap is None else list_cap + 1, "kv_indptr entries"),
            _capacity(kv_last_len.numel(), list_cap, "lists"),
            _capacity(kv_indices.numel(), self.max_num_pages, "kv_indices entries"),
            _capacity(tails.numel(), self.max_batch_size, "tail_index entries"),
        )
        if any(c > have for c, have in zip(caps, self._caps, strict=True)):
            # A fixed capacity is allocated exactly; a growing one to at least twice its size.
            fixed = (list_cap is not None, list_cap is not None, self.max_num_pages is not None, list_cap is not None)
            grown = (c if f or c <= h else max(c, 2 * h) for c, h, f in zip(caps, self._caps, fixed, strict=True))
            self._allocate(tuple(max(g, h) for g, h in zip(grown, self._caps, strict=True)))
        o_last, o_indices, o_tails = _offsets(self._caps)
        end = o_tails + tails.numel() if tails.numel() else o_indices + kv_indices.numel()
        if self.device.type != "cuda":
            host = self._packed
        else:
            if self._copied is not None:
                self._copied.synchronize()  # the previous plan's copy has left the staging tensor
            host = self._staging
        host[: kv_indptr.numel()].copy_(kv_indptr)
        host[o_last : o_last + kv_last_len.numel()].copy_(kv_last_len)
        host[o_indices : o_indices + kv_indices.numel()].copy_(kv_indices)
        host[o_tails : o_tails + tails.numel()].copy_(tails)
        if self.device.type == "cuda":
            self._packed[:end].copy_(host[:end], non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def _allocate(self, caps: tuple[int, int, int, int]) -> None:
        """New packed buffers for ``caps`` entries (moves the views: graphs captured before are stale)."""
        self._caps = caps
        o_last, o_indices, o_tails = _offsets(caps)
        total = o_tails + caps[3]
        self._packed = self._int32(total)
        if self.device.type == "cuda":
            if self._copied is not None:
                self._copied.synchronize()
            self._staging = torch.empty(total, dtype=torch.int32, pin_memory=True)
        self.indptr = self._packed[: caps[0]]
        self.last_len = self._packed[o_last : o_last + caps[1]]
        self.indices = self._packed[o_indices : o_indices + caps[2]]
        self.tail_index = self._packed[o_tails : o_tails + caps[3]]

    def reserve_scratch(self, batch: int, num_qo_heads: int, num_kv_heads: int, block_d: int) -> None:
        """Size the split-K scratch for ``batch`` (or for every batch up to ``max_batch_size``)."""
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(f"batch {batch} exceeds the fixed capacity max_batch_size={self.max_batch_size}")
        key = (num_qo_heads, num_kv_heads, block_d)
        if self.max_batch_size is not None and key == self._scratch_key:
            return  # sized for every batch up to the capacity already
        sizes = range(1, self.max_batch_size + 1) if self.max_batch_size is not None else (batch,)
        rows = max(
            b * num_qo_heads * max(self.num_splits(b, num_kv_heads), self.num_splits(b, num_kv_heads, True, 1))
            for b in sizes
        )
        lse_rows = max(sizes) * num_qo_heads
        if self.o_part.numel() < rows * block_d:
            self.o_part = torch.empty(_grown(self.o_part.numel(), rows * block_d), device=self.device)
        if self.lse_part.numel() < rows:
            self.lse_part = torch.empty(_grown(self.lse_part.numel(), rows), device=self.device)
        if self.lse.numel() < lse_rows:
            self.lse = torch.empty(_grown(self.lse.numel(), lse_rows), device=self.device)
        self._scratch_key = key

    def num_splits(
        self,
        batch: int,
        num_kv_heads: int,
        quantized: bool = False,
        program_warps: int = 4,
        warps_per_sm: int | None = None,
    ) -> int:
        """The split count (the scratch holds any quantized launch's, down to one-warp programs)."""
        return self.forced_splits or choose_num_splits(
            batch, num_kv_heads, self.device, quantized, program_warps, warps_per_sm
        )

    def _int32(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)


def _capacity(needed: int, capacity: int | None, what: str) -> int:
    """Entries a buffer must have: its fixed capacity (checked), or what this plan needs."""
    if capacity is None:
        return needed
    if needed > capacity:
        raise ValueError(f"plan needs {needed} {what} but the fixed capacity is {capacity}")
    return capacity


def _offsets(caps: tuple[int, int, int, int]) -> tuple[int, int, int]:
    """Starts of ``last_len``, ``indices`` and ``tail_index`` in the packed buffer, 16-entry (64-byte) aligned."""
    o_last = -(-caps[0] // 16) * 16
    o_indices = o_last + -(-caps[1] // 16) * 16
    return o_last, o_indices, o_indices + -(-caps[2] // 16) * 16


def _grown(current: int, needed: int) -> int:
    return max(needed, 2 * current)
