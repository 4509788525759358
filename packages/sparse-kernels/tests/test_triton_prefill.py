"""Triton paged prefill (varlen, causal to each KV end, GQA) against the per-request oracle.

Runs natively on CUDA where present, else on CPU under Triton's interpreter (small sizes there).
Tolerances as in test_paged_prefill: fp32 uses IEEE fp32 dots (1e-5); bf16 agrees to ~1 bf16 ulp (2e-2).
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchPrefillWithPagedKVCache

NUM_KV_HEADS = 2
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _b17() -> tuple[list[int], list[int]]:
    """Batch 17: KV lengths 1, 97, 40, 17 cycling; even requests prefill all, odd ones a suffix."""
    kv_lens = [[1, 97, 40, 17][b % 4] for b in range(17)]
    qo_lens = [n if b % 2 == 0 else max(1, n // 3) for b, n in enumerate(kv_lens)]
    return qo_lens, kv_lens


# (qo_lens, kv_lens, block_size, group, head_dim, dtype): a covering set over the awkward sizes.
CASES = {
    "b17-bs16-g4-d64-fp32": (*_b17(), 16, 4, 64, torch.float32),
    "b17-bs1-g1-d128-bf16": (*_b17(), 1, 1, 128, torch.bfloat16),
    "prefix1100-bs1-g8-d128-fp32": ([40], [1100], 1, 8, 128, torch.float32),
    "prefix1100-bs16-g4-d64-bf16": ([70, 1], [1100, 97], 16, 4, 64, torch.bfloat16),
    "kv1-bs16-g8-d64-fp32": ([1, 1], [1, 1], 16, 8, 64, torch.float32),
}


def _make(paged_batch, device, qo_lens, kv_lens, block_size, group, head_dim, dtype, seed=0):
    return paged_batch(
        qo_lens,
        kv_lens,
        block_size=block_size,
        num_qo_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    ).to(device)


@pytest.mark.parametrize("case", CASES)
def test_prefill_triton_matches_oracle(paged_batch, triton_device, case):
    qo_lens, kv_lens, block_size, group, head_dim, dtype = CASES[case]
    batch = _make(paged_batch, triton_device, qo_lens, kv_lens, block_size, group, head_dim, dtype)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper)
    out = torch.full_like(batch.q, float("nan"))
    assert wrapper.run(batch.q, batch.k_cache, batch.v_cache, out=out) is out
    torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[dtype])


def test_prefill_triton_non_causal_custom_scale_strided_rows(paged_batch, triton_device):
    batch = _make(paged_batch, triton_device, [5, 30, 2], [9, 30, 70], 16, 4, 64, torch.float32, seed=2)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper, causal=False, sm_scale=0.3)
    wide_q = torch.randn(batch.q.shape[0], 3 * 8, 64, device=triton_device)
    wide_q[:, 8:16] = batch.q
    wide_out = torch.full((batch.q.shape[0] + 2, 8, 64), float("nan"), device=triton_device)
    wrapper.run(wide_q[:, 8:16], batch.k_cache, batch.v_cache, out=wide_out[2:])
    torch.testing.assert_close(wide_out[2:].cpu(), batch.reference(sm_scale=0.3, causal=False), **TOL[torch.float32])
    assert wide_out[:2].isnan().all()


def test_prefill_triton_rejects_mismatched_inputs(paged_batch, triton_device):
    batch = _make(paged_batch, triton_device, [3, 2], [5, 2], 4, 2, 16, torch.float32)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    batch.plan_prefill(wrapper)
    with pytest.raises(ValueError, match="q must be"):
        wrapper.run(batch.q[:-1], batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="out must be"):
        wrapper.run(batch.q, batch.k_cache, batch.v_cache, out=torch.empty_like(batch.q, dtype=torch.float64))
