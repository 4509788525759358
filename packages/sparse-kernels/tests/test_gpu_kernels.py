"""GPU only, full sizes: every Triton kernel against the reference backend on the same device.

Tolerances as in the interpreter tests (fp32 1e-5 with IEEE dots; bf16 2e-2; scores 1e-4), except
that long fp32 rows sum thousands of terms in a different order, hence 2e-5 there.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import (
    BatchDecodeWithPagedKVCache,
    BatchPrefillWithPagedKVCache,
    block_summary,
    compact_kv,
    store_kv,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_KV_HEADS = 2
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
SCORE_TOL = {"atol": 1e-4, "rtol": 1e-3}
LONG_CYCLE = [1, 97, 1000, 4097, 16, 17, 2500]
# A covering set of (block_size, group, head_dim, dtype): every value of each axis, every pair of
# block size and dtype, without the full product's 24 kernel compiles per kernel.
MATRIX = [
    (1, 1, 64, torch.float32),
    (1, 4, 128, torch.bfloat16),
    (1, 8, 64, torch.bfloat16),
    (16, 1, 128, torch.bfloat16),
    (16, 4, 64, torch.float32),
    (16, 8, 128, torch.float32),
    (16, 8, 128, torch.bfloat16),
    (1, 8, 128, torch.float32),
]


def _ids(case):
    block_size, group, head_dim, dtype = case
    return f"bs{block_size}-g{group}-d{head_dim}-{str(dtype).split('.')[-1]}"


def _batch(paged_batch, qo_lens, kv_lens, block_size, group, head_dim, dtype, seed=0):
    return paged_batch(
        qo_lens,
        kv_lens,
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    ).to("cuda")


def _scores(batch, page_size, rows=NUM_KV_HEADS):
    shape = (rows, int(batch.kv_indptr[-1]) * page_size) if rows else (int(batch.kv_indptr[-1]) * page_size,)
    return torch.full(shape, float("nan"), device="cuda")


@pytest.mark.parametrize("case", MATRIX, ids=_ids)
def test_decode_full_matrix(paged_batch, case):
    block_size, group, head_dim, dtype = case
    kv_lens = [LONG_CYCLE[b % len(LONG_CYCLE)] for b in range(17)]
    batch = _batch(paged_batch, [1] * 17, kv_lens, block_size, group, head_dim, dtype)
    results = []
    for backend in ("triton", "reference"):
        wrapper = BatchDecodeWithPagedKVCache("cuda", backend=backend)
        batch.plan_decode(wrapper)
        scores = _scores(batch, block_size)
        results.append((wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores), scores))
    (out, scores), (ref_out, ref_scores) = results
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(scores, ref_scores, **SCORE_TOL)
    torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[dtype])


@pytest.mark.parametrize("batch_size", [1, 3])
def test_decode_32k_split_k(paged_batch, batch_size):
    batch = _batch(paged_batch, [1] * batch_size, [32768, 3, 20000][:batch_size], 16, 4, 128, torch.bfloat16)
    outs = []
    for backend in ("triton", "reference"):
        wrapper = BatchDecodeWithPagedKVCache("cuda", backend=backend)
        batch.plan_decode(wrapper)
        scores = _scores(batch, 16)
        outs.append((wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores), scores))
    torch.testing.assert_close(outs[0][0], outs[1][0], **TOL[torch.bfloat16])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("slots", [False, True], ids=["block-lists", "slot-lists"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_sparse_full(paged_batch, head_lists, slots, dtype):
    kv_lens = [LONG_CYCLE[b % len(LONG_CYCLE)] for b in range(17)]
    batch = _batch(paged_batch, [1] * 17, kv_lens, 16, 4, 128, dtype, seed=7)
    lists = head_lists(batch, slots=slots, seed=8)
    results = []
    for backend in ("triton", "reference"):
        wrapper = BatchDecodeWithPagedKVCache("cuda", backend=backend)
        lists.plan(wrapper, batch)
        scores = _scores(lists, lists.page_size, rows=0)
        results.append((wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores), scores))
    torch.testing.assert_close(results[0][0], results[1][0], **TOL[dtype])
    torch.testing.assert_close(results[0][1], results[1][1], **SCORE_TOL)
    out, scores = lists.reference(batch)
    torch.testing.assert_close(results[0][0].cpu(), out, **TOL[dtype])


@pytest.mark.parametrize("case", MATRIX, ids=_ids)
def test_prefill_full_matrix(paged_batch, case):
    block_size, group, head_dim, dtype = case
    kv_lens = [LONG_CYCLE[b % len(LONG_CYCLE)] for b in range(17)]
    qo_lens = [n if b % 3 == 0 else max(1, n // 5) for b, n in enumerate(kv_lens)]
    batch = _batch(paged_batch, qo_lens, kv_lens, block_size, group, head_dim, dtype)
    wrapper = BatchPrefillWithPagedKVCache("cuda", backend="triton")
    batch.plan_prefill(wrapper)
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    reference = BatchPrefillWithPagedKVCache("cuda", backend="reference")
    batch.plan_prefill(reference)
    torch.testing.assert_close(out, reference.run(batch.q, batch.k_cache, batch.v_cache), **TOL[dtype])


def test_store_summary_compact_large():
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (4096, 16, 8, 128)
    k_cache = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    caches = {b: (k_cache.clone(), v_cache.clone()) for b in ("triton", "reference")}
    rows = torch.randn(300, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    slots = torch.randperm(4096 * 16, device="cuda", generator=gen)[:300].to(torch.int32)
    slots[::7] = -1
    ids = torch.randperm(4096, device="cuda", generator=gen)[:1000].to(torch.int32)
    valid = torch.randint(0, 17, (1000,), device="cuda", generator=gen, dtype=torch.int32)
    slot_ids = torch.randperm(4096 * 16, device="cuda", generator=gen)[:6000].to(torch.int32)
    slot_indptr = torch.tensor([0, 1000, 6000], dtype=torch.int32, device="cuda")
    keep_indptr = torch.tensor([0, 500, 3000], dtype=torch.int32, device="cuda")
    keep = torch.cat([_sorted_keep(1000, 500, gen), _sorted_keep(5000, 2500, gen)], dim=1)  # [8, 3000]
    summaries = {}
    for backend, (k, v) in caches.items():
        store_kv(rows, rows, k, v, slots, backend=backend)
        kmin, kmax = torch.zeros(4096, 8, 128, device="cuda"), torch.zeros(4096, 8, 128, device="cuda")
        block_summary(k, ids, valid, kmin, kmax, backend=backend)
        summaries[backend] = (kmin, kmax)
        compact_kv(k, v, slot_ids, keep, slot_indptr=slot_indptr, keep_indptr=keep_indptr, backend=backend)
    for a, b in zip(caches["triton"], caches["reference"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(summaries["triton"], summaries["reference"], strict=True):
        assert torch.equal(a, b)


def _sorted_keep(length, count, gen):
    """Per head, ``count`` distinct positions of a ``length``-slot list, ascending."""
    return torch.sort(torch.rand(8, length, device="cuda", generator=gen).argsort(1)[:, :count], dim=1).values
