"""update_block_summaries (Triton and reference) against block_summary recomputation, decode by decode."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import block_summary, update_block_summaries


@pytest.mark.parametrize("summary_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_updates_equal_recomputation(summary_dtype, backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, d = 10, 4, 2, 32
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.bfloat16, device=device)
    kmin = torch.zeros(num_blocks, hkv, d, dtype=summary_dtype, device=device)
    kmax = torch.zeros_like(kmin)
    tables = [[3, 7, 1], [0, 9, 5], [8, 2, 6]]  # three requests, appended one token per step
    for step in range(9):
        slots = []
        for r, table in enumerate(tables):
            if r == 2 and step % 3 == 1:
                slots.append(-1)  # a padding row this step (request 2 skips every third step)
                continue
            pos = step if r < 2 else [0, None, 1, 2, None, 3, 4, None, 5][step]
            slots.append(table[pos // bs] * bs + pos % bs)
        slot_mapping = torch.tensor(slots, dtype=torch.int32, device=device)
        for s in slots:
            if s >= 0:
                k_cache.view(-1, hkv, d)[s] = torch.randn(hkv, d, generator=gen).to(torch.bfloat16).to(device)
        update_block_summaries(k_cache, slot_mapping, kmin, kmax, backend=backend)
        valid_slots = [s for s in slots if s >= 0]
        ids = torch.tensor([s // bs for s in valid_slots], dtype=torch.int32, device=device)
        counts = torch.tensor([s % bs + 1 for s in valid_slots], dtype=torch.int32, device=device)
        exp_min, exp_max = kmin.clone(), kmax.clone()
        block_summary(k_cache, ids, counts, exp_min, exp_max, backend="reference")
        torch.testing.assert_close(kmin.cpu(), exp_min.cpu(), rtol=0, atol=0)
        torch.testing.assert_close(kmax.cpu(), exp_max.cpu(), rtol=0, atol=0)


def test_all_padding_changes_nothing():
    k_cache = torch.randn(4, 4, 2, 16)
    kmin, kmax = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    before = (kmin.clone(), kmax.clone())
    update_block_summaries(k_cache, torch.full((3,), -1, dtype=torch.int32), kmin, kmax, backend="triton")
    update_block_summaries(k_cache, torch.full((3,), -1, dtype=torch.int32), kmin, kmax, backend="reference")
    assert torch.equal(kmin, before[0]) and torch.equal(kmax, before[1])
