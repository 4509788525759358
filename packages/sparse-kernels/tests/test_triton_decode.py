"""Triton split-K decode against the per-request oracle and the reference backend, dense and head-sparse.

Runs natively on CUDA where present, else on CPU under Triton's interpreter (sizes kept small there).
Tolerances: fp32 runs IEEE fp32 dots, so only the split-K summation order differs (1e-5). bf16 inputs
are identical for kernel and oracle; the kernel rounds probabilities to bf16 before P @ V (as flash
attention does) and the output to bf16, so outputs agree to about one bf16 ulp (2e-2). Scores are fp32
probabilities from the same bf16 inputs: 1e-4 absolute.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache

NUM_KV_HEADS = 2
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
SCORE_TOL = {"atol": 1e-4, "rtol": 1e-3}
CYCLE = [1, 97, 300, 16, 17]

# (batch, kv_lens, block_size, group, head_dim, dtype, forced splits): a covering set, not a product.
CASES = {
    "b17-bs16-g4-d64-fp32": (17, None, 16, 4, 64, torch.float32, None),
    "b17-bs1-g8-d128-fp32": (17, None, 1, 8, 128, torch.float32, None),
    "b17-bs16-g1-d128-bf16": (17, None, 16, 1, 128, torch.bfloat16, None),
    "long-bs16-g8-d64-bf16": (3, [1500, 1, 97], 16, 8, 64, torch.bfloat16, 7),
    "long-bs1-g4-d128-fp32": (1, [1100], 1, 4, 128, torch.float32, None),
    "b5-bs16-g1-d64-fp32-splits": (5, [1, 97, 64, 65, 300], 16, 1, 64, torch.float32, 5),
}


def _batch(paged_batch, device, batch_size, kv_lens, block_size, group, head_dim, dtype, seed=0):
    kv_lens = kv_lens or [CYCLE[b % len(CYCLE)] for b in range(batch_size)]
    batch = paged_batch(
        [1] * batch_size,
        kv_lens,
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    return batch.to(device)


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_oracle_with_scores(paged_batch, scores_oracle, triton_device, case):
    batch_size, kv_lens, block_size, group, head_dim, dtype, splits = CASES[case]
    batch = _batch(paged_batch, triton_device, batch_size, kv_lens, block_size, group, head_dim, dtype)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton", num_splits=splits)
    batch.plan_decode(wrapper)
    out = torch.full_like(batch.q, float("nan"))
    scores = torch.full((NUM_KV_HEADS, int(batch.kv_indptr[-1]) * block_size), float("nan"), device=triton_device)
    assert wrapper.run(batch.q, batch.k_cache, batch.v_cache, out=out, scores_out=scores) is out
    torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[dtype])
    torch.testing.assert_close(scores.cpu(), scores_oracle(batch), **SCORE_TOL)


@pytest.mark.parametrize("slots", [False, True], ids=["block-lists", "slot-lists"])
@pytest.mark.parametrize(("group", "dtype"), [(4, torch.float32), (8, torch.bfloat16)])
def test_head_sparse_triton_and_reference_match_oracle(paged_batch, head_lists, triton_device, slots, group, dtype):
    batch = _batch(paged_batch, triton_device, 7, [1, 97, 300, 16, 17, 40, 129], 16, group, 64, dtype, seed=3)
    lists = head_lists(batch, slots=slots, seed=4)
    expected_out, expected_scores = lists.reference(batch)
    for backend in ("triton", "reference"):
        wrapper = BatchDecodeWithPagedKVCache(triton_device, backend=backend)
        lists.plan(wrapper, batch)
        scores = torch.full((int(lists.kv_indptr[-1]) * lists.page_size,), float("nan"), device=triton_device)
        out = wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores)
        torch.testing.assert_close(out.cpu(), expected_out, **TOL[dtype])
        torch.testing.assert_close(scores.cpu(), expected_scores, **SCORE_TOL)


def test_reference_backend_scores_and_plain_run_agree(paged_batch, scores_oracle):
    batch = _batch(paged_batch, "cpu", 9, None, 16, 4, 64, torch.float32)
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    batch.plan_decode(wrapper)
    plain = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    scores = torch.full((NUM_KV_HEADS, int(batch.kv_indptr[-1]) * 16), float("nan"))
    with_scores = wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores)
    torch.testing.assert_close(with_scores, plain, **TOL[torch.float32])
    torch.testing.assert_close(plain, batch.reference(), **TOL[torch.float32])
    torch.testing.assert_close(scores, scores_oracle(batch), **SCORE_TOL)


def test_one_plan_serves_layers_and_strided_rows(paged_batch, triton_device):
    # q and out as row slices of wider buffers (the engine's fused QKV and mixed decode/prefill outputs).
    batch = _batch(paged_batch, triton_device, 4, [5, 97, 33, 1], 16, 4, 64, torch.float32)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton")
    batch.plan_decode(wrapper)
    wide_q = torch.randn(4, 3 * 8, 64, device=triton_device)
    wide_q[:, :8] = batch.q
    wide_out = torch.full((6, 8, 64), float("nan"), device=triton_device)
    for layer in range(2):
        k_cache = batch.k_cache * (layer + 1)
        wrapper.run(wide_q[:, :8], k_cache, batch.v_cache, out=wide_out[1:5])
        expected = BatchDecodeWithPagedKVCache(triton_device, backend="reference")
        batch.plan_decode(expected)
        torch.testing.assert_close(wide_out[1:5], expected.run(batch.q, k_cache, batch.v_cache), **TOL[torch.float32])
    assert wide_out[0].isnan().all() and wide_out[5].isnan().all()


def test_fixed_capacity_keeps_buffers_and_rejects_overflow(paged_batch, triton_device):
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend="triton", max_batch_size=4, max_num_pages=40)
    first = _batch(paged_batch, triton_device, 3, [5, 97, 33], 16, 4, 64, torch.float32)
    first.plan_decode(wrapper)
    pointers = [t.data_ptr() for t in (wrapper._buffers.indptr, wrapper._buffers.indices, wrapper._buffers.o_part)]
    second = _batch(paged_batch, triton_device, 4, [300, 1, 2, 200], 16, 4, 64, torch.float32, seed=1)
    second.plan_decode(wrapper)
    assert [
        t.data_ptr() for t in (wrapper._buffers.indptr, wrapper._buffers.indices, wrapper._buffers.o_part)
    ] == pointers
    torch.testing.assert_close(
        wrapper.run(second.q, second.k_cache, second.v_cache).cpu(), second.reference(), **TOL[torch.float32]
    )
    too_many = _batch(paged_batch, triton_device, 5, None, 16, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="capacity"):
        too_many.plan_decode(wrapper)
    too_long = _batch(paged_batch, triton_device, 1, [41 * 16], 16, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="capacity"):
        too_long.plan_decode(wrapper)


def test_decode_plan_rejects_bad_head_sparse_layouts():
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    layout = dict(num_qo_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="B \\* num_kv_heads \\+ 1"):
        wrapper.plan(i32(0, 1, 2, 3), i32(0, 1, 2), i32(1, 1, 1), **layout, head_sparse=True)
    with pytest.raises(ValueError, match="page_size must be a positive divisor"):
        wrapper.plan(i32(0, 1, 2), i32(0, 1), i32(1, 1), **layout, head_sparse=True, page_size=3)
    with pytest.raises(ValueError, match="kv_last_len entries"):
        wrapper.plan(i32(0, 1, 2), i32(0, 1), i32(1, 2), **layout, head_sparse=True, page_size=1)
    wrapper.plan(i32(0, 1, 2), i32(0, 1), i32(1, 1), **layout, head_sparse=True, page_size=1)
    with pytest.raises(ValueError, match="scores_out must be float32 \\[2\\]"):
        wrapper.run(
            torch.zeros(1, 4, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), scores_out=torch.zeros(2, 2)
        )
