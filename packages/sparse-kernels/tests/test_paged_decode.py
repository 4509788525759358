"""BatchDecodeWithPagedKVCache (reference backend) against the per-request oracle, one query per request."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache, BatchPrefillWithPagedKVCache

NUM_KV_HEADS = 2
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}  # same reasoning as the prefill tests: ~1 bf16 ulp


def _decode(batch, *, block_size, head_dim, group, **kwargs):
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference", **kwargs)
    batch.plan_decode(wrapper)
    return wrapper.run(batch.q, batch.k_cache, batch.v_cache)


def _kv_lens(batch_size: int) -> list[int]:
    return [[1, 97, 300, 16, 17][b % 5] for b in range(batch_size)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("batch_size", [1, 17])
def test_decode_matches_reference_fp32(paged_batch, batch_size, block_size, group, head_dim):
    kv_lens = [300] if batch_size == 1 else _kv_lens(batch_size)
    batch = paged_batch(
        [1] * batch_size,
        kv_lens,
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
    )
    out = _decode(batch, block_size=block_size, head_dim=head_dim, group=group)
    assert out.shape == (batch_size, group * NUM_KV_HEADS, head_dim)
    torch.testing.assert_close(out, batch.reference(), **FP32_TOL)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 8])
def test_decode_matches_reference_bf16(paged_batch, block_size, group):
    batch = paged_batch(
        [1] * 17,
        _kv_lens(17),
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=128,
        dtype=torch.bfloat16,
        seed=5,
    )
    out = _decode(batch, block_size=block_size, head_dim=128, group=group)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, batch.reference(), **BF16_TOL)


def test_decode_kv_len_one(paged_batch):
    # A single key: the output is exactly that key's value, per GQA group.
    batch = paged_batch([1, 1], [1, 1], block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    out = _decode(batch, block_size=16, head_dim=64, group=4)
    for b in range(2):
        torch.testing.assert_close(out[b], batch.v_seqs[b][0].repeat_interleave(4, dim=0))


def test_decode_equals_single_query_prefill(paged_batch):
    batch = paged_batch([1] * 6, _kv_lens(6), block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    prefill = BatchPrefillWithPagedKVCache("cpu", backend="reference")
    batch.plan_prefill(prefill)
    expected = prefill.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(_decode(batch, block_size=16, head_dim=64, group=4), expected, atol=0, rtol=0)


def test_decode_tiled(paged_batch):
    batch = paged_batch([1] * 9, _kv_lens(9), block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    out = _decode(batch, block_size=16, head_dim=64, group=4, max_tile_elements=50_000)
    torch.testing.assert_close(out, batch.reference(), **FP32_TOL)


def test_decode_rejects_bad_plan_and_run():
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(torch.zeros(1, 2, 8), torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8))
    indptr = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_last_len entries"):
        wrapper.plan(
            indptr,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32),
            num_qo_heads=2,
            num_kv_heads=2,
            head_dim=8,
            block_size=4,
        )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        wrapper.plan(
            indptr,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            num_qo_heads=3,
            num_kv_heads=2,
            head_dim=8,
            block_size=4,
        )
    wrapper.plan(
        indptr,
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        num_qo_heads=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
    )
    with pytest.raises(ValueError, match="q must be"):
        wrapper.run(torch.zeros(2, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8))
