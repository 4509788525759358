"""paged_logits (Triton and reference) against per-row contiguous keys."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import paged_logits


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_logits_equal_contiguous_keys(backend, paged_batch, triton_device):
    device = triton_device if backend == "triton" else "cpu"
    kv_lens = [5, 40, 1, 70]
    batch = paged_batch([1] * 4, kv_lens, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32)
    q = batch.q.bfloat16().float()
    starts = batch.kv_indptr[:-1].to(torch.int64)
    out = torch.empty(4, 8, 80, device=device)
    paged_logits(
        q.to(device),
        torch.nan_to_num(batch.k_cache).to(device),
        batch.kv_indices.to(device),
        starts.to(device),
        torch.tensor(kv_lens).to(device),
        out,
        scale=0.5,
        backend=backend,
    )
    expected = torch.full((4, 8, 80), float("-inf"))
    for b, k in enumerate(batch.k_seqs):
        k = k.repeat_interleave(4, dim=1)  # [n, Hq, D]
        expected[b, :, : k.shape[0]] = torch.einsum("hd,nhd->hn", q[b], k) * 0.5
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
