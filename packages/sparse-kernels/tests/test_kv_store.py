"""store_kv writes rows to their slots and leaves the pool untouched for -1 padded rows (both backends).

The Triton backend runs natively on CUDA where present, else on CPU under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import store_kv

SHAPE = (6, 4, 2, 8)  # [num_blocks, block_size, Hkv, D] -> 24 slots


def _pool(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=gen).to(dtype), torch.randn(SHAPE, generator=gen).to(dtype)


def _rows(n, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 8, generator=gen).to(dtype), torch.randn(n, 2, 8, generator=gen).to(dtype)


def _expected(k_cache, v_cache, key, value, slots):
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            k_exp.view(-1, 2, 8)[slot] = key[row]
            v_exp.view(-1, 2, 8)[slot] = value[row]
    return k_exp, v_exp


@pytest.mark.parametrize(
    "slots",
    [
        [0, 5, 23, 7, 12],  # plain scatter, last slot of the pool included
        [-1, 3, -1, 9],  # padding first, so the donor row is not row 0
        [-1, 0, -1, -1],  # padded rows share slot 0 with a real write
        [4, 5, 6, -1, -1, -1],  # CUDA-graph bucket: real rows then padding
        [-1, -1, -1],  # all padding: nothing may change
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_store_matches_manual_scatter(slots, dtype, backend, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    k_cache, v_cache = _pool(dtype)
    key, value = _rows(len(slots), dtype)
    k_exp, v_exp = _expected(k_cache, v_cache, key, value, slots)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=device)
    store_kv(key.to(device), value.to(device), k_cache, v_cache, slot_mapping, backend=backend)
    torch.testing.assert_close(k_cache.cpu(), k_exp, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), v_exp, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_strided_rows_and_cast(dtype, triton_device):
    # key/value as head slices of a fused QKV row (strided), fp32 rows into a bf16/fp32 pool.
    k_cache, v_cache = (t.to(triton_device) for t in _pool(dtype))
    k_ref, v_ref = k_cache.cpu().clone(), v_cache.cpu().clone()
    qkv = torch.randn(5, 6, 8, device=triton_device)
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([3, -1, 17, 0, 23], dtype=torch.int32, device=triton_device)
    store_kv(key, value, k_cache, v_cache, slots, backend="triton")
    store_kv(key.cpu(), value.cpu(), k_ref, v_ref, slots.cpu(), backend="reference")
    torch.testing.assert_close(k_cache.cpu(), k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), v_ref, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_rows_leave_pool_untouched_even_with_nan_rows(backend, triton_device):
    # Padded rows carry garbage (here NaN); it must never reach the pool.
    device = triton_device if backend == "triton" else "cpu"
    k_cache, v_cache = (t.to(device) for t in _pool())
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = (t.to(device) for t in _rows(4))
    key[[0, 2]] = float("nan")
    value[[0, 2]] = float("nan")
    slots = torch.tensor([-1, 10, -1, 11], dtype=torch.int32, device=device)
    store_kv(key, value, k_cache, v_cache, slots, backend=backend)
    untouched = torch.ones(24, dtype=torch.bool, device=device)
    untouched[[10, 11]] = False
    torch.testing.assert_close(k_cache.view(-1, 2, 8)[untouched], k_before.view(-1, 2, 8)[untouched], atol=0, rtol=0)
    torch.testing.assert_close(v_cache.view(-1, 2, 8)[untouched], v_before.view(-1, 2, 8)[untouched], atol=0, rtol=0)
    torch.testing.assert_close(k_cache.view(-1, 2, 8)[[10, 11]], key[[1, 3]], atol=0, rtol=0)
    assert not torch.isnan(k_cache).any() and not torch.isnan(v_cache).any()


def test_store_casts_to_cache_dtype_and_handles_empty():
    # The reference path (auto on CPU unless SPARSE_KERNELS_BACKEND says otherwise).
    k_cache, v_cache = _pool(torch.bfloat16)
    key, value = _rows(2, torch.float32)
    store_kv(key, value, k_cache, v_cache, torch.tensor([1, 2], dtype=torch.int32))
    torch.testing.assert_close(k_cache.view(-1, 2, 8)[[1, 2]], key.to(torch.bfloat16), atol=0, rtol=0)
    before = k_cache.clone()
    store_kv(key[:0], value[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int32))
    assert torch.equal(k_cache, before)


def test_store_rejects_bad_inputs():
    k_cache, v_cache = _pool()
    key, value = _rows(2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        store_kv(key, value, k_cache, v_cache, slots.to(torch.int64))
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        store_kv(key, value, k_cache, v_cache, slots[:1])
    with pytest.raises(ValueError, match="key and value"):
        store_kv(key, value[:1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cache heads/head_dim"):
        store_kv(key[..., :4], value[..., :4], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(key, value, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots)


@pytest.mark.parametrize(
    ("slots", "n_copy"),
    [
        ([0, 5, 23, 7, 12], 3),  # the first rows copied, the rest only stored
        ([4, 5, -1, -1], 4),  # padded rows copy too (into rows the caller reserved for them)
        ([-1, -1, -1], 2),  # no pool write at all: the copy still happens
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_store_copies_query_rows(slots, n_copy, dtype, backend, triton_device):
    """``copy_into[copy_index[i]] = copy_rows[i]`` for the first rows, pool writes unchanged, other rows of
    ``copy_into`` untouched; ``copy_rows`` may be a strided view (a merged projection's q heads)."""
    device = triton_device if backend == "triton" else "cpu"
    k_cache, v_cache = _pool(dtype)
    key, value = _rows(len(slots), dtype)
    k_exp, v_exp = _expected(k_cache, v_cache, key, value, slots)
    gen = torch.Generator().manual_seed(7)
    merged = torch.randn(len(slots), 3, 4, 8, generator=gen).to(dtype)  # [T, 3 parts, 4 heads, D]
    queries = merged[:n_copy, 1]  # [n, 4, 8], row stride 96
    into = torch.randn(9, 4, 8, generator=gen).to(dtype)
    index = torch.tensor([6, 0, 8, 3, 1][:n_copy] + [2, 2], dtype=torch.int64)  # longer than the rows copied
    into_exp = into.clone()
    into_exp[index[:n_copy]] = queries
    k_cache, v_cache, into = k_cache.to(device), v_cache.to(device), into.to(device)
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=device)
    store_kv(
        key.to(device), value.to(device), k_cache, v_cache, slot_mapping,
        copy_rows=merged.to(device)[:n_copy, 1],
        copy_into=into, copy_index=index.to(device), backend=backend,
    )  # fmt: skip
    torch.testing.assert_close(k_cache.cpu(), k_exp, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), v_exp, atol=0, rtol=0)
    torch.testing.assert_close(into.cpu(), into_exp, atol=0, rtol=0)


def test_store_copy_arguments_checked():
    k_cache, v_cache = _pool()
    key, value = _rows(2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    rows, into, index = torch.zeros(2, 4, 8), torch.zeros(5, 4, 8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="go together"):
        store_kv(key, value, k_cache, v_cache, slots, copy_rows=rows, copy_into=into)
    with pytest.raises(ValueError, match="shaped like"):
        store_kv(key, value, k_cache, v_cache, slots, copy_rows=rows, copy_into=torch.zeros(5, 2, 8), copy_index=index)
    with pytest.raises(ValueError, match="int64"):
        store_kv(key, value, k_cache, v_cache, slots, copy_rows=rows, copy_into=into, copy_index=index.int())
    with pytest.raises(ValueError, match="at most"):
        store_kv(key, value, k_cache, v_cache, slots, copy_rows=torch.zeros(3, 4, 8), copy_into=into, copy_index=index)
