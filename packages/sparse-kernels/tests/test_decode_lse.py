"""The decode wrapper's ``lse_out``: each query head's natural-log softmax denominator over its listed
tokens, on the Triton kernel (whose own lse is base 2) and the reference, dense and head-sparse plans; and
two decodes over disjoint halves of each list, merged (``merge_states``), equal the decode of the whole."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache, merge_states

HEADS, GROUP, DIM, BLOCK = 2, 4, 32, 16
SHAPE = dict(block_size=BLOCK, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, head_dim=DIM)


def _oracle_lse(batch, positions=None) -> torch.Tensor:
    """``[B, Hq]`` logsumexp of ``scale * q . k`` over each request's tokens (or per-list ``positions``)."""
    q = batch.q.cpu().float().view(batch.q.shape[0], HEADS, GROUP, DIM)
    lse = torch.empty(q.shape[:3])
    for b, k in enumerate(batch.k_seqs):
        for h in range(HEADS):
            keys = k[:, h] if positions is None else k[positions[b * HEADS + h], h]
            lse[b, h] = torch.logsumexp(q[b, h] @ keys.float().T * DIM**-0.5, dim=-1)
    return lse.view(q.shape[0], -1)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_dense_and_head_sparse_lse(paged_batch, head_lists, triton_device, backend):
    kv_lens = [1, 97, 40, 300, 17]
    batch = paged_batch([1] * 5, kv_lens, **SHAPE)
    batch = batch.to(triton_device)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend=backend, num_splits=3 if backend == "triton" else None)
    batch.plan_decode(wrapper)
    lse = torch.full((5, HEADS * GROUP), float("nan"), device=triton_device)
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache, lse_out=lse)
    torch.testing.assert_close(out.cpu(), batch.reference(causal=False), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), _oracle_lse(batch), atol=1e-5, rtol=1e-5)
    lists = head_lists(batch, slots=True, seed=1)
    lists.plan(wrapper, batch)
    wrapper.run(batch.q, batch.k_cache, batch.v_cache, lse_out=lse)
    torch.testing.assert_close(lse.cpu(), _oracle_lse(batch, lists.positions), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_disjoint_halves_merge_into_the_whole(paged_batch, triton_device, backend):
    """Slot lists: each (request, KV head) split into its even and its odd positions; the two decodes,
    merged, equal dense decode."""
    kv_lens = [2, 97, 300]
    batch = paged_batch([1] * 3, kv_lens, **SHAPE)
    batch = batch.to(triton_device)
    states = []
    for parity in (0, 1):
        indptr, indices = [0], []
        for b, n in enumerate(kv_lens):
            blocks = batch.kv_indices[int(batch.kv_indptr[b]) : int(batch.kv_indptr[b + 1])].long()
            pos = torch.arange(parity, n, 2)
            for _ in range(HEADS):
                indices.append((blocks[pos // BLOCK] * BLOCK + pos % BLOCK).to(torch.int32))
                indptr.append(indptr[-1] + pos.numel())
        wrapper = BatchDecodeWithPagedKVCache(triton_device, backend=backend)
        lists = len(kv_lens) * HEADS
        wrapper.plan(
            torch.tensor(indptr, dtype=torch.int32),
            torch.cat(indices),
            torch.ones(lists, dtype=torch.int32),
            head_sparse=True,
            page_size=1,
            **SHAPE,
        )
        lse = torch.empty(len(kv_lens), HEADS * GROUP, device=triton_device)
        states += [wrapper.run(batch.q, batch.k_cache, batch.v_cache, lse_out=lse).float(), lse]
    merged = merge_states(*states)
    torch.testing.assert_close(merged.cpu(), batch.reference(causal=False), atol=1e-5, rtol=1e-5)


def test_lse_out_is_checked(paged_batch):
    batch = paged_batch([1], [5], **SHAPE)
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    batch.plan_decode(wrapper)
    for bad in (torch.empty(1, HEADS), torch.empty(1, HEADS * GROUP, dtype=torch.float64)):
        with pytest.raises(ValueError, match="lse_out"):
            wrapper.run(batch.q, batch.k_cache, batch.v_cache, lse_out=bad)
