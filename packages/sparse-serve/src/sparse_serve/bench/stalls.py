"""What may stall a timed window besides the kernels: the CUDA caching allocator going to the driver, and
Python's garbage collector.

A pipelined decode hides up to one step of host time behind the device; a host pause longer than that
(a collection of a large generation, a ``cudaFree`` that synchronizes the device because the cache ran out
of room next to a KV pool that fills the GPU) leaves the device idle and shows as a step several times the
median. ``StallProbe`` counts both over a window: the allocator's retries (a failed ``cudaMalloc`` that
freed cached blocks and tried again), device allocations and frees, and each collection's generation and
duration (through ``gc.callbacks``).
"""

from __future__ import annotations

import gc
import time

import torch

_ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


class StallProbe:
    """``start()`` then ``stop()`` around a window: ``stop`` returns the allocator counters' growth (CUDA
    only) and the collections by generation (count, total and longest milliseconds)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._allocator: dict[str, int] = {}
        self._collections: list[tuple[int, float]] = []
        self._started: float | None = None

    def _counters(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {key: int(stats.get(key, 0)) for key in _ALLOCATOR_KEYS}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._collections.append((int(info["generation"]), (time.perf_counter() - self._started) * 1e3))
            self._started = None

    def start(self) -> None:
        self._allocator = self._counters()
        self._collections = []
        gc.callbacks.append(self._on_gc)

    def stop(self) -> dict:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        after = self._counters()
        collections: dict[str, dict] = {}
        for generation, ms in self._collections:
            entry = collections.setdefault(str(generation), {"count": 0, "ms": 0.0, "max_ms": 0.0})
            entry["count"] += 1
            entry["ms"] = round(entry["ms"] + ms, 3)
            entry["max_ms"] = round(max(entry["max_ms"], ms), 3)
        return {"allocator": {k: after[k] - self._allocator.get(k, 0) for k in after}, "gc": collections}
