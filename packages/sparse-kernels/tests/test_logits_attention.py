"""softmax_stats, logits_attention and head_max_probs (Triton and reference) against plain attention
over each row's contiguous keys and values, and against torch.softmax."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import causal_attention, paged_logits
from sparse_kernels.head_max_probs import head_max_probs
from sparse_kernels.logits_attention import logits_attention, softmax_stats

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
        m,
        s,
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
@pytest.mark.parametrize(("sink", "recent"), [(0, 0), (2, 3)])
def test_head_max_probs_equal_softmax_max(backend, sink, recent, paged_batch, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    batch = paged_batch([1] * 4, KV_LENS, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, seed=3)
    logits, _ = _logits(batch, batch.q, 80, 0.3)
    m, s = logits.amax(-1), torch.exp(logits - logits.amax(-1, keepdim=True)).sum(-1)
    out = torch.empty(4, 80, device=device)
    lens = torch.tensor(KV_LENS)
    head_max_probs(
        logits.to(device), m.to(device), s.to(device), lens.to(device), out, sink=sink, recent=recent, backend=backend
    )
    expected = torch.softmax(logits, dim=-1).amax(1)
    tok = torch.arange(80)[None, :]
    forced = (tok < sink) | ((tok >= lens[:, None] - recent) & (tok < lens[:, None]))
    expected = expected.masked_fill(forced, float("inf")).masked_fill(tok >= lens[:, None], float("-inf"))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-7)
