"""StallProbe: collections in its window are counted by generation with their durations; nothing outside
it; the allocator's counters are read on CUDA only."""

from __future__ import annotations

import gc

import pytest
import torch

from sparse_serve.bench.stalls import StallProbe


def test_collections_in_the_window_are_counted_by_generation():
    probe = StallProbe(torch.device("cpu"))
    gc.collect()  # before the window: not counted
    probe.start()
    gc.collect()
    gc.collect(0)
    report = probe.stop()
    gc.collect()  # after it: not counted either
    assert report["allocator"] == {}
    assert report["gc"]["2"]["count"] == 1 and report["gc"]["0"]["count"] >= 1
    assert report["gc"]["2"]["ms"] >= report["gc"]["2"]["max_ms"] > 0
    assert probe._on_gc not in gc.callbacks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_allocator_counters_grow_with_device_allocations():
    device = torch.device("cuda")
    probe = StallProbe(device)
    probe.start()
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # a fresh segment: one cudaMalloc
    del x
    torch.cuda.empty_cache()  # and its cudaFree
    report = probe.stop()
    assert report["allocator"]["num_device_alloc"] >= 1 and report["allocator"]["num_device_free"] >= 1
