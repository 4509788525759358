"""The decode wrapper's ``logits_out``: with one read of K, the raw logit ``sm_scale * q . k_j`` of every
listed token per query head (column ``j`` = token ``j`` of the request's list, columns past it untouched),
next to the output and ``lse_out``; for bf16/float KV (``run``) and the per-token quantized stores
(``run_quantized``: fp8, TurboQuant, over the dequantized keys), on the Triton kernel (natively on CUDA,
interpreted on CPU) and the reference. The truth is written here: a loop over each request's keys."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache

HEADS, GROUP, DIM, BLOCK = 2, 4, 32, 16
SHAPE = dict(block_size=BLOCK, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, head_dim=DIM)
WIDTH = 320  # columns of logits_out: more than the longest list
SENTINEL = -7.0  # what columns past a list keep


def _oracle(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], dim: int):
    """Per request: logits ``[Hq, n]``, their log-sum-exp ``[Hq]`` and the attention output ``[Hq, D]``."""
    q = q.cpu().float()
    group = q.shape[1] // keys[0].shape[1]
    result = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        kk = k.float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        vv = v.float().repeat_interleave(group, dim=1)
        logits = torch.stack([kk[:, h] @ q[b, h] for h in range(q.shape[1])]) * dim**-0.5
        probs = torch.softmax(logits, dim=-1)
        out = torch.stack([probs[h] @ vv[:, h] for h in range(q.shape[1])])
        result.append((logits, torch.logsumexp(logits, dim=-1), out))
    return result


def _check(oracle, logits, lse, out, kv_lens, tol):
    for b, (want_logits, want_lse, want_out) in enumerate(oracle):
        n = kv_lens[b]
        torch.testing.assert_close(logits[b, :, :n].cpu(), want_logits, **tol)
        assert (logits[b, :, n:] == SENTINEL).all(), "columns past the list must stay untouched"
        torch.testing.assert_close(lse[b].cpu(), want_lse, **tol)
        torch.testing.assert_close(out[b].cpu().float(), want_out, **tol)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_logits_out_bf16_pool(paged_batch, triton_device, backend):
    kv_lens = [1, 97, 40, 300, 17]
    batch = paged_batch([1] * 5, kv_lens, **SHAPE).to(triton_device)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend=backend, num_splits=3 if backend == "triton" else None)
    batch.plan_decode(wrapper)
    logits = torch.full((5, HEADS * GROUP, WIDTH), SENTINEL, device=triton_device)
    lse = torch.empty(5, HEADS * GROUP, device=triton_device)
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache, lse_out=lse, logits_out=logits)
    oracle = _oracle(batch.q, batch.k_seqs, batch.v_seqs, DIM)
    _check(oracle, logits, lse, out, kv_lens, dict(atol=1e-5, rtol=1e-5))
    # exp(logits - lse) are the probabilities: each row sums to 1 over its list
    for b, n in enumerate(kv_lens):
        sums = torch.exp(logits[b, :, :n] - lse[b, :, None]).sum(-1)
        torch.testing.assert_close(sums.cpu(), torch.ones(HEADS * GROUP), atol=1e-5, rtol=1e-5)


QUANT_TOL = {"cpu": {"atol": 1e-4, "rtol": 1e-4}, "cuda": {"atol": 2e-2, "rtol": 2e-2}}


@pytest.mark.parametrize(("scheme", "bits"), [("fp8", 8), ("turboquant", 3)], ids=["fp8", "turboquant3"])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["rows", "swapped"])
def test_logits_out_quantized(quantized_batch, triton_device, scheme, bits, swap_ab, monkeypatch):
    """Over the dequantized keys (TurboQuant: its rotated query and keys give the same logits), with the dots as
    written and transposed (``SWAP_AB``, where the logits leave as a token-major tile)."""
    from sparse_kernels._triton import quantized_decode_launch

    monkeypatch.setitem(quantized_decode_launch.QUANT_DECODE_CONFIG, "SWAP_AB", swap_ab)
    kv_lens = [1, 97, 40, 33]
    batch = quantized_batch(kv_lens, scheme=scheme, bits=bits, block_size=16, num_kv_heads=HEADS, head_dim=64)
    q = torch.randn(4, GROUP * HEADS, 64, generator=torch.Generator().manual_seed(1))
    oracle = _oracle(q, batch.k_seqs, batch.v_seqs, 64)
    kv = batch.kv_on(triton_device)
    for backend in ("triton", "reference"):
        wrapper = BatchDecodeWithPagedKVCache(
            triton_device, backend=backend, num_splits=2 if backend == "triton" else None
        )
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_len, num_qo_heads=GROUP * HEADS, **batch.layout())
        logits = torch.full((4, GROUP * HEADS, 128), SENTINEL, device=triton_device)
        lse = torch.empty(4, GROUP * HEADS, device=triton_device)
        out = wrapper.run_quantized(q.to(triton_device), kv, lse_out=lse, logits_out=logits)
        _check(oracle, logits, lse, out, kv_lens, QUANT_TOL[torch.device(triton_device).type])


def test_logits_out_is_checked(paged_batch, head_lists, quantized_batch):
    batch = paged_batch([1, 1], [5, 40], **SHAPE)
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    batch.plan_decode(wrapper)
    for bad in (
        torch.empty(2, HEADS * GROUP, 39),  # narrower than the longest list
        torch.empty(2, HEADS, 64),  # KV heads instead of query heads
        torch.empty(2, HEADS * GROUP, 64, dtype=torch.float64),
        torch.empty(2, HEADS * GROUP, 64)[:, :, ::2],  # strided columns
    ):
        with pytest.raises(ValueError, match="logits_out must be float32"):
            wrapper.run(batch.q, batch.k_cache, batch.v_cache, logits_out=bad)
    ok = torch.empty(2, HEADS * GROUP, 40)
    head_lists(batch, slots=True, seed=1).plan(wrapper, batch)
    with pytest.raises(ValueError, match="needs a dense plan"):
        wrapper.run(batch.q, batch.k_cache, batch.v_cache, logits_out=ok)
    kivi = quantized_batch([16, 32], scheme="kivi", bits=4, block_size=16, num_kv_heads=HEADS, head_dim=32)
    wrapper.plan(kivi.kv_indptr, kivi.kv_indices, kivi.kv_last_len, num_qo_heads=HEADS * GROUP, **kivi.layout())
    with pytest.raises(ValueError, match="KIVI store is not built"):
        wrapper.run_quantized(torch.zeros(2, HEADS * GROUP, 32), kivi.kv, logits_out=ok)
