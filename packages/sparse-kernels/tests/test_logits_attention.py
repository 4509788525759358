"""softmax_stats, logits_attention and head_max_probs (Triton and reference) against plain attention
over each row's contiguous keys and values, and against torch.softmax."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import causal_attention, paged_logits
from sparse_kernels.head_max_probs import head_max_probs
from sparse_kernels.logits_attention import logits_attention, logits_lse, softmax_stats

KV_LENS = [5, 40, 1, 70]


def _logits(batch, q, width, scale):
    starts = batch.kv_indptr[:-1].to(torch.int64)
    out = torch.empty(len(KV_LENS), q.shape[1], width)
    k = torch.nan_to_num(batch.k_cache)
    paged_logits(q, k, batch.kv_indices, starts, torch.tensor(KV_LENS), out, scale=scale, backend="reference")
    return out, starts


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_from_logits_equals_attention(backend, paged_batch, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    batch = paged_batch([1] * 4, KV_LENS, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, seed=2)
    q, scale = batch.q, 32**-0.5
    logits, starts = _logits(batch, q, 80, scale)
    m = torch.empty(4, 8, device=device)
    s = torch.empty(4, 8, device=device)
    softmax_stats(logits.to(device), m, s, backend=backend)
    torch.testing.assert_close(m.cpu(), logits.amax(-1))
    torch.testing.assert_close(s.cpu(), torch.exp(logits - logits.amax(-1, keepdim=True)).sum(-1))
    out = torch.full((4, 8, 32), float("nan"), device=device)
    logits_attention(
        logits.to(device),
        logits_lse(logits.to(device), backend=backend),
        torch.nan_to_num(batch.v_cache).to(device),
        batch.kv_indices.to(device),
        starts.to(device),
        torch.tensor(KV_LENS).to(device),
        out,
        backend=backend,
    )
    for b, (k, v) in enumerate(zip(batch.k_seqs, batch.v_seqs, strict=True)):
        expected = causal_attention(q[b : b + 1], k, v, sm_scale=scale, causal=False)[0]
        torch.testing.assert_close(out[b].cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_logits_lse_is_each_rows_log_sum_exp(backend, triton_device):
    from sparse_kernels.logits_attention import logits_lse

    device = triton_device if backend == "triton" else "cpu"
    logits = torch.randn(3, 4, 70, generator=torch.Generator().manual_seed(5)) * 4
    logits[0, :, 50:] = float("-inf")  # columns past a row
    got = logits_lse(logits.to(device), backend=backend)
    torch.testing.assert_close(got.cpu(), torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("sink", "recent"), [(0, 0), (2, 3)])
def test_head_max_probs_equal_softmax_max(backend, sink, recent, paged_batch, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    batch = paged_batch([1] * 4, KV_LENS, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, seed=3)
    logits, _ = _logits(batch, batch.q, 80, 0.3)
    lse = torch.logsumexp(logits, -1)
    out = torch.empty(4, 80, device=device)
    lens = torch.tensor(KV_LENS)
    head_max_probs(logits.to(device), lse.to(device), lens.to(device), out, sink=sink, recent=recent, backend=backend)
    expected = torch.softmax(logits, dim=-1).amax(1)
    tok = torch.arange(80)[None, :]
    forced = (tok < sink) | ((tok >= lens[:, None] - recent) & (tok < lens[:, None]))
    expected = expected.masked_fill(forced, float("inf")).masked_fill(tok >= lens[:, None], float("-inf"))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("scheme", "bits"), [("fp8", 8), ("turboquant", 3), ("turboquant", 4)])
def test_logits_and_attention_over_codes_equal_attention_over_dequantized_kv(
    backend, scheme, bits, quantized_batch, triton_device
):
    """A per-token quantized store (OmniKV's filter layers over fp8 or TurboQuant): ``paged_logits`` with
    ``k_scale`` (and TurboQuant's ``codebook``, the query rotated in) and ``logits_attention`` with ``v_scale``
    (the output rotated back) equal plain attention over the dequantized K/V (on a GPU the dots take fp16
    operands: the query is rounded)."""
    device = triton_device if backend == "triton" else "cpu"
    batch = quantized_batch(KV_LENS, scheme=scheme, bits=bits, block_size=16, num_kv_heads=2, head_dim=32, seed=4)
    kv = batch.kv_on(device)
    q = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(5))
    rotation = None if kv.rotation is None else kv.rotation.cpu().float()
    q_in = q if rotation is None else q @ rotation  # TurboQuant attends in the rotated space
    tol = dict(rtol=1e-4, atol=1e-4) if torch.device(device).type == "cpu" else dict(rtol=2e-2, atol=2e-2)
    starts = batch.kv_indptr[:-1].to(torch.int64).to(device)
    lens = torch.tensor(KV_LENS).to(device)
    table = batch.kv_indices.to(device)
    logits = torch.empty(4, 8, 80, device=device)
    codes = dict(codebook=kv.codebook) if scheme == "turboquant" else {}
    args = (table, starts, lens, logits)
    paged_logits(q_in.to(device), kv.k, *args, scale=0.5, k_scale=kv.k_scale, **codes, backend=backend)
    for b, k in enumerate(batch.k_seqs):
        n = k.shape[0]
        expected = torch.einsum("hd,nhd->hn", q[b], k.repeat_interleave(4, dim=1)) * 0.5
        torch.testing.assert_close(logits[b, :, :n].cpu(), expected, **tol)
        assert torch.isinf(logits[b, :, n:]).all()
    out = torch.full((4, 8, 32), float("nan"), device=device)
    lse = logits_lse(logits, backend=backend)
    logits_attention(logits, lse, kv.v, table, starts, lens, out, v_scale=kv.v_scale, **codes, backend=backend)
    out = out.cpu() if rotation is None else out.cpu() @ rotation.T
    for b, (k, v) in enumerate(zip(batch.k_seqs, batch.v_seqs, strict=True)):
        expected = causal_attention(q[b : b + 1], k, v, sm_scale=0.5, causal=False)[0]
        torch.testing.assert_close(out[b], expected, **tol)


def test_token_scales_need_an_fp8_cache():
    k = torch.zeros(3, 16, 2, 32)
    out = torch.empty(1, 4, 16)
    args = (torch.zeros(1, 4, 32), k, torch.zeros(1, dtype=torch.int32), torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="fp8"):
        paged_logits(*args, out, scale=1.0, k_scale=torch.ones(3, 16, 2))
    with pytest.raises(ValueError, match="k_scale must be contiguous float32"):
        paged_logits(args[0], k.to(torch.float8_e4m3fn), *args[2:], out, scale=1.0, k_scale=torch.ones(3, 16))


def test_a_codebook_needs_packed_codes_and_their_scales(quantized_batch):
    tq = quantized_batch([17], scheme="turboquant", bits=3, block_size=16, num_kv_heads=2, head_dim=32).kv
    out = torch.empty(1, 4, 16)
    args = (torch.zeros(1, 4, 32), tq.k, torch.zeros(1, dtype=torch.int32), torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_logits(*args, out, scale=1.0, codebook=tq.codebook)
    with pytest.raises(ValueError, match="codebook must be"):
        paged_logits(*args, out, scale=1.0, k_scale=tq.k_scale, codebook=tq.codebook[:6])
    with pytest.raises(ValueError, match="int32 packed indices"):
        paged_logits(args[0], tq.k.float(), *args[2:], out, scale=1.0, k_scale=tq.k_scale, codebook=tq.codebook)
