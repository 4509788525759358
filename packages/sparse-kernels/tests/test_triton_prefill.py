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


# Tile configurations the kernel must get right whatever the default is: GQA-packed rows (one program
# per KV head holding its group's heads), tiles narrower and wider than a page, more than one warp group.
CONFIGS = {
    "packed-m64-n32": {"BLOCK_M": 64, "BLOCK_N": 32, "PACK": True, "num_warps": 4, "num_stages": 2},
    "rows-m32-n16": {"BLOCK_M": 32, "BLOCK_N": 16, "PACK": False, "num_warps": 4, "num_stages": 2},
    "packed-m128-n64": {"BLOCK_M": 128, "BLOCK_N": 64, "PACK": True, "num_warps": 8, "num_stages": 3},
}


@pytest.mark.parametrize(
    "config, case",
    [
        ("packed-m64-n32", "b17-bs16-g4-d64-fp32"),
        ("rows-m32-n16", "b17-bs16-g4-d64-fp32"),
        ("packed-m128-n64", "prefix1100-bs16-g4-d64-bf16"),
    ],
)
def test_prefill_triton_tile_configs_match_oracle(paged_batch, triton_device, monkeypatch, config, case):
    from sparse_kernels._triton import prefill

    monkeypatch.setattr(prefill, "PREFILL_CONFIG", CONFIGS[config])
    qo_lens, kv_lens, block_size, group, head_dim, dtype = CASES[case]
    batch = _make(paged_batch, triton_device, qo_lens, kv_lens, block_size, group, head_dim, dtype, seed=3)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper)
    pack = group if CONFIGS[config]["PACK"] else 1
    assert wrapper._plan.tile_queries == CONFIGS[config]["BLOCK_M"] // pack
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[dtype])


def _windowed_reference(batch, window_left: int) -> torch.Tensor:
    """Plain causal attention where a query at p sees keys p - window_left .. p only."""
    outs = []
    for b, (k, v) in enumerate(zip(batch.k_seqs, batch.v_seqs, strict=True)):
        q = batch.q[int(batch.qo_indptr[b]) : int(batch.qo_indptr[b + 1])].cpu().float()
        n, group = k.shape[0], q.shape[1] // k.shape[1]
        pos = torch.arange(n - q.shape[0], n)[:, None]
        keys = torch.arange(n)[None, :]
        visible = (keys <= pos) & (keys >= pos - window_left)
        kk, vv = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", q, kk) * q.shape[-1] ** -0.5
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
    return torch.cat(outs)


@pytest.mark.parametrize("packed, window_left", [(True, 0), (False, 5), (True, 40)])
def test_prefill_triton_window(paged_batch, triton_device, monkeypatch, packed, window_left):
    import dataclasses

    from sparse_kernels._triton import prefill

    config = CONFIGS["packed-m64-n32" if packed else "rows-m32-n16"]
    monkeypatch.setattr(prefill, "PREFILL_CONFIG", config)
    batch = _make(paged_batch, triton_device, [70, 1, 9], [130, 97, 9], 16, 4, 64, torch.float32, seed=4)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper)
    plan = dataclasses.replace(wrapper._plan, window_left=window_left)
    out = torch.empty_like(batch.q)
    prefill.run_prefill_triton(plan, batch.q, batch.k_cache, batch.v_cache, out)
    torch.testing.assert_close(out.cpu(), _windowed_reference(batch, window_left), **TOL[torch.float32])
