"""compact_kv (Triton and reference) against an element-by-element oracle, in place over overlaps."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import compact_kv


def _case(num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """Three requests over a shuffled pool of 4-slot blocks, each head keeping its own sorted positions."""
    gen = torch.Generator().manual_seed(seed)
    lens, keeps = [13, 1, 40], [5, 1, 17]
    perm = torch.randperm(80, generator=gen)
    slot_lists = [perm[:13], perm[13:14], perm[20:60]]
    keep = []
    for n, m in zip(lens, keeps, strict=True):
        rows = [torch.sort(torch.randperm(n, generator=gen)[:m]).values for _ in range(num_kv_heads)]
        keep.append(torch.stack(rows))
    keep[2][0] = torch.arange(23, 40)  # one head keeps the tail: every source overlaps a destination
    k_cache = torch.randn(20, 4, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(20, 4, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, slot_lists, keep


def _expected(cache, slot_lists, keep):
    flat = cache.clone().view(-1, cache.shape[2], cache.shape[3])
    old = flat.clone()
    for slots, k in zip(slot_lists, keep, strict=True):
        for h in range(k.shape[0]):
            for i in range(k.shape[1]):
                flat[slots[i], h] = old[slots[k[h, i]], h]
    return flat.view_as(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_batched_compaction_matches_oracle(dtype, backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    k_cache, v_cache, slot_lists, keep = _case(dtype=dtype)
    k_exp, v_exp = _expected(k_cache, slot_lists, keep), _expected(v_cache, slot_lists, keep)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)

    def indptr(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    compact_kv(
        k_cache,
        v_cache,
        torch.cat(slot_lists).to(torch.int32).to(device),
        torch.cat(keep, dim=1).to(device),
        slot_indptr=indptr([len(s) for s in slot_lists]),
        keep_indptr=indptr([k.shape[1] for k in keep]),
        backend=backend,
    )
    torch.testing.assert_close(k_cache.cpu(), k_exp, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), v_exp, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_single_request_int32_keep(backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    k_cache, v_cache, slot_lists, keep = _case(num_kv_heads=4, head_dim=64, seed=3)
    slots, kept = slot_lists[2], keep[2]
    k_exp = _expected(k_cache, [slots], [kept])
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    compact_kv(k_cache, v_cache, slots.to(torch.int32).to(device), kept.to(torch.int32).to(device), backend=backend)
    torch.testing.assert_close(k_cache.cpu(), k_exp, atol=0, rtol=0)


def test_reference_handles_unsorted_keep():
    k_cache, v_cache, slot_lists, keep = _case()
    reversed_keep = keep[0].flip(1)
    k_exp = _expected(k_cache, [slot_lists[0]], [reversed_keep])
    compact_kv(k_cache, v_cache, slot_lists[0].to(torch.int32), reversed_keep, backend="reference")
    torch.testing.assert_close(k_cache, k_exp, atol=0, rtol=0)


def test_compact_rejects_bad_inputs():
    k_cache, v_cache, slot_lists, keep = _case()
    slots = slot_lists[0].to(torch.int32)
    with pytest.raises(ValueError, match="slot_ids must be"):
        compact_kv(k_cache, v_cache, slots.long(), keep[0])
    with pytest.raises(ValueError, match="keep must be"):
        compact_kv(k_cache, v_cache, slots, keep[0][:1])
    with pytest.raises(ValueError, match="both"):
        compact_kv(k_cache, v_cache, slots, keep[0], slot_indptr=torch.tensor([0, 13], dtype=torch.int32))
    with pytest.raises(ValueError, match="columns"):
        compact_kv(k_cache, v_cache, slots[:2], keep[0])
