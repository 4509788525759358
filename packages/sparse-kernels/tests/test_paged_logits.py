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


# Many one-step chunks per row, head_dim 96 (the masked load along d) / one long loop per row.
@pytest.mark.parametrize(("target_programs", "head_dim"), [(2048, 96), (8, 64)])
def test_awkward_batch_matches_the_reference(target_programs, head_dim, paged_batch, triton_device, monkeypatch):
    """Batch 17 (lengths 1 to 41 pages of 16 and partial pages), bf16 keys and queries in a shuffled
    pool: Triton's logits (16-bit dots on a GPU) equal the reference's."""
    from sparse_kernels._triton import paged_logits as kernel
    from sparse_kernels._triton import stream_split

    monkeypatch.setattr(stream_split, "TARGET_PROGRAMS", target_programs)
    monkeypatch.setitem(kernel.CONFIG, "BLOCK_N", 32)
    gen = torch.Generator().manual_seed(head_dim)
    kv_lens = [41 * 16, 1, 17, *torch.randint(1, 41 * 16, (14,), generator=gen).tolist()]
    batch = paged_batch([1] * 17, kv_lens, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=head_dim)
    args = (
        batch.q.bfloat16(),
        torch.nan_to_num(batch.k_cache).bfloat16(),
        batch.kv_indices,
        batch.kv_indptr[:-1],
        torch.tensor(kv_lens, dtype=torch.int32),
    )
    expected = torch.empty(17, 8, 41 * 16 + 5)
    paged_logits(*args, expected, scale=0.3, backend="reference")
    out = torch.empty(17, 8, 41 * 16 + 5, device=triton_device)
    paged_logits(*(a.to(triton_device) for a in args), out, scale=0.3, backend="triton")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-4)
