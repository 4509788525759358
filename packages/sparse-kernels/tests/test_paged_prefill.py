"""BatchPrefillWithPagedKVCache (reference backend) against the per-request oracle on awkward sizes and layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_kernels import BatchPrefillWithPagedKVCache

NUM_KV_HEADS = 2
# bf16 inputs are identical for kernel and oracle and both accumulate in fp32; only reduction order
# differs, so outputs land within about one bf16 ulp (2**-8 relative) of each other.
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


def _plan_run(batch, *, block_size, head_dim, group, causal=True, sm_scale=None, **kwargs):
    wrapper = BatchPrefillWithPagedKVCache("cpu", backend="reference", **kwargs)
    batch.plan_prefill(wrapper, causal=causal, sm_scale=sm_scale)
    return wrapper.run(batch.q, batch.k_cache, batch.v_cache)


def _make(paged_batch, qo_lens, kv_lens, *, block_size, head_dim, group, dtype=torch.float32, seed=0):
    return paged_batch(
        qo_lens,
        kv_lens,
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )


SINGLE_CASES = {"kv1": ([1], [1]), "kv97-prefix": ([40], [97]), "kv300-full": ([300], [300])}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("case", ["batch17", *SINGLE_CASES])
def test_prefill_matches_reference_fp32(paged_batch, lengths, case, block_size, group, head_dim):
    qo_lens, kv_lens = lengths(17) if case == "batch17" else SINGLE_CASES[case]
    batch = _make(paged_batch, qo_lens, kv_lens, block_size=block_size, head_dim=head_dim, group=group)
    out = _plan_run(batch, block_size=block_size, head_dim=head_dim, group=group)
    assert out.dtype == torch.float32 and out.shape == batch.q.shape
    torch.testing.assert_close(out, batch.reference(), **FP32_TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_matches_reference_bf16(paged_batch, lengths, block_size, group, head_dim):
    qo_lens, kv_lens = lengths(17, seed=1)
    batch = _make(
        paged_batch, qo_lens, kv_lens, block_size=block_size, head_dim=head_dim, group=group, dtype=torch.bfloat16
    )
    out = _plan_run(batch, block_size=block_size, head_dim=head_dim, group=group)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, batch.reference(), **BF16_TOL)


def test_prefill_non_causal_and_custom_scale(paged_batch, lengths):
    qo_lens, kv_lens = lengths(9, seed=2)
    batch = _make(paged_batch, qo_lens, kv_lens, block_size=16, head_dim=64, group=4)
    out = _plan_run(batch, block_size=16, head_dim=64, group=4, causal=False, sm_scale=0.3)
    torch.testing.assert_close(out, batch.reference(sm_scale=0.3, causal=False), **FP32_TOL)


@pytest.mark.parametrize("max_tile_elements", [1, 5_000, 300_000])
def test_tiling_matches_single_tile(paged_batch, lengths, max_tile_elements):
    # A tiny cap forces one-row query chunks; mid caps mix request groups and query chunks.
    qo_lens, kv_lens = lengths(7, seed=3)
    batch = _make(paged_batch, qo_lens, kv_lens, block_size=16, head_dim=64, group=4)
    tiled = _plan_run(batch, block_size=16, head_dim=64, group=4, max_tile_elements=max_tile_elements)
    whole = _plan_run(batch, block_size=16, head_dim=64, group=4, max_tile_elements=2**40)
    torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tiled, batch.reference(), **FP32_TOL)


def test_one_plan_many_layers_and_out_buffer(paged_batch, lengths):
    qo_lens, kv_lens = lengths(5, seed=4)
    batch = _make(paged_batch, qo_lens, kv_lens, block_size=16, head_dim=64, group=4)
    wrapper = BatchPrefillWithPagedKVCache("cpu", backend="reference")
    batch.plan_prefill(wrapper)
    out = torch.full_like(batch.q, float("nan"))
    for layer in range(2):
        k_cache, v_cache = batch.k_cache * (layer + 1), batch.v_cache
        result = wrapper.run(batch.q, k_cache, v_cache, out=out)
        assert result is out
        expected = BatchPrefillWithPagedKVCache("cpu", backend="reference")
        batch.plan_prefill(expected)
        torch.testing.assert_close(out, expected.run(batch.q, k_cache, v_cache), atol=0, rtol=0)


# The fixture only hands back a pure builder, so sharing it across examples is safe.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    batch_size=st.integers(1, 5),
    block_size=st.sampled_from([1, 2, 3, 16]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16, 64]),
    causal=st.booleans(),
    cap=st.sampled_from([64, 4096, 2**28]),
)
def test_prefill_property(paged_batch, data, batch_size, block_size, group, head_dim, causal, cap):
    kv_lens = data.draw(st.lists(st.integers(1, 40), min_size=batch_size, max_size=batch_size))
    qo_lens = [data.draw(st.integers(1, n)) for n in kv_lens]
    batch = paged_batch(
        qo_lens,
        kv_lens,
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        seed=data.draw(st.integers(0, 2**16)),
    )
    out = _plan_run(batch, block_size=block_size, head_dim=head_dim, group=group, causal=causal, max_tile_elements=cap)
    torch.testing.assert_close(out, batch.reference(causal=causal), **FP32_TOL)


def test_run_before_plan_raises():
    with pytest.raises(RuntimeError, match="plan"):
        BatchPrefillWithPagedKVCache("cpu", backend="reference").run(
            torch.zeros(1, 2, 8), torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8)
        )


def test_run_rejects_mismatched_inputs(paged_batch):
    batch = _make(paged_batch, [3, 2], [5, 2], block_size=4, head_dim=8, group=2)
    wrapper = BatchPrefillWithPagedKVCache("cpu", backend="reference")
    batch.plan_prefill(wrapper)
    with pytest.raises(ValueError, match="q must be"):
        wrapper.run(batch.q[:-1], batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="cache block shape"):
        wrapper.run(batch.q, batch.k_cache[:, :2], batch.v_cache[:, :2])
    with pytest.raises(ValueError, match="k_cache/v_cache"):
        wrapper.run(batch.q, batch.k_cache, batch.v_cache[:1])
    with pytest.raises(ValueError, match="out must be"):
        wrapper.run(batch.q, batch.k_cache, batch.v_cache, out=torch.empty_like(batch.q, dtype=torch.float64))
