"""The decode's ``merge_with``: states over keys the lists leave out, merged in the decode's reduce. Each (request,
KV head) lists its even positions; its odd ones come as ``S`` partial states over disjoint chunks, computed
here by a plain softmax (an empty chunk: ``lse = -inf`` and a NaN output, which must not leak). The merged
output and ``lse_out`` equal dense decode over every token, on the Triton kernel and the reference; the
chunks' ``reduce_states`` equals the softmax over their union; bad states are clear errors."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchDecodeWithPagedKVCache
from sparse_kernels.merge_states import reduce_states

HEADS, GROUP, DIM, BLOCK = 2, 4, 32, 16
SHAPE = dict(block_size=BLOCK, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, head_dim=DIM)
SCALE = DIM**-0.5


def _softmax_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[G, D]`` over keys ``k`` / ``v`` ``[n, D]``: normalised output ``[G, D]`` and natural lse ``[G]``
    (an empty set: NaN output, ``-inf`` lse)."""
    if k.shape[0] == 0:
        return torch.full((q.shape[0], DIM), float("nan")), torch.full((q.shape[0],), float("-inf"))
    s = q.double() @ k.double().T * SCALE
    return (torch.softmax(s, -1) @ v.double()).float(), torch.logsumexp(s, -1).float()


def _split(batch, chunks: int):
    """Head-sparse slot lists of the even positions, and the odd positions' states in ``chunks`` parts."""
    n = len(batch.k_seqs)
    q = batch.q.cpu().float().view(n, HEADS, GROUP, DIM)
    indptr, indices = [0], []
    x_out = torch.empty(n, HEADS, GROUP, chunks, DIM)
    x_lse = torch.empty(n, HEADS, GROUP, chunks)
    for b, (k, v) in enumerate(zip(batch.k_seqs, batch.v_seqs, strict=True)):
        blocks = batch.kv_indices[int(batch.kv_indptr[b]) : int(batch.kv_indptr[b + 1])].long()
        kv_len = k.shape[0]
        even, odd = torch.arange(0, kv_len, 2), torch.arange(1, kv_len, 2)
        parts = odd.tensor_split(chunks)  # the last ones may be empty (short requests)
        for h in range(HEADS):
            indices.append((blocks[even // BLOCK] * BLOCK + even % BLOCK).to(torch.int32))
            indptr.append(indptr[-1] + even.numel())
            for c, pos in enumerate(parts):
                x_out[b, h, :, c], x_lse[b, h, :, c] = _softmax_state(q[b, h], k[pos, h].float(), v[pos, h].float())
    lists = (torch.tensor(indptr, dtype=torch.int32), torch.cat(indices), torch.ones(n * HEADS, dtype=torch.int32))
    return lists, x_out.view(n, HEADS * GROUP, chunks, DIM), x_lse.view(n, HEADS * GROUP, chunks)


def _oracle_lse(batch) -> torch.Tensor:
    q = batch.q.cpu().float().view(len(batch.k_seqs), HEADS, GROUP, DIM)
    lse = torch.empty(q.shape[:3])
    for b, k in enumerate(batch.k_seqs):
        for h in range(HEADS):
            lse[b, h] = torch.logsumexp(q[b, h].double() @ k[:, h].double().T * SCALE, dim=-1).float()
    return lse.view(q.shape[0], -1)


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_merged_states_equal_dense_decode(paged_batch, triton_device, backend, chunks):
    kv_lens = [2, 5, 97, 300]  # 2 and 5: one odd position or two, so some chunks are empty
    batch = paged_batch([1] * len(kv_lens), kv_lens, **SHAPE)
    lists, x_out, x_lse = _split(batch, chunks)
    batch = batch.to(triton_device)
    wrapper = BatchDecodeWithPagedKVCache(triton_device, backend=backend)
    wrapper.plan(*lists, head_sparse=True, page_size=1, **SHAPE)
    lse = torch.full((len(kv_lens), HEADS * GROUP), float("nan"), device=triton_device)
    merge = (x_out.to(triton_device), x_lse.to(triton_device))
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache, lse_out=lse, merge_with=merge)
    torch.testing.assert_close(out.cpu(), batch.reference(causal=False), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), _oracle_lse(batch), atol=1e-5, rtol=1e-5)
    again = wrapper.run(batch.q, batch.k_cache, batch.v_cache, merge_with=merge)  # no lse_out: the same output
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_reduce_states_is_the_softmax_over_the_union():
    """Chunks of one set of keys, reduced, equal that set's softmax; all-empty gives ``out = 0``, ``-inf``."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, DIM, generator=g), torch.randn(40, DIM, generator=g), torch.randn(40, DIM, generator=g)
    parts = [_softmax_state(q, k[lo:hi], v[lo:hi]) for lo, hi in ((0, 7), (7, 7), (7, 40))]
    out, lse = reduce_states(torch.stack([p[0] for p in parts], 1), torch.stack([p[1] for p in parts], 1))
    want_out, want_lse = _softmax_state(q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    empty = _softmax_state(q, k[:0], v[:0])
    out, lse = reduce_states(empty[0][:, None], empty[1][:, None])
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_merge_with_is_checked(paged_batch):
    batch = paged_batch([1, 1], [5, 9], **SHAPE)
    wrapper = BatchDecodeWithPagedKVCache("cpu", backend="reference")
    batch.plan_decode(wrapper)
    good_out, good_lse = torch.zeros(2, HEADS * GROUP, 2, DIM), torch.zeros(2, HEADS * GROUP, 2)
    bad = [
        (torch.zeros(2, HEADS * GROUP, DIM), torch.zeros(2, HEADS * GROUP)),  # no split axis
        (torch.zeros(2, HEADS, 2, DIM), torch.zeros(2, HEADS, 2)),  # KV heads, not query heads
        (good_out, torch.zeros(2, HEADS * GROUP, 3)),  # lse of another split count
        (good_out.double(), good_lse.double()),
        (torch.zeros(2, HEADS * GROUP, DIM, 2).transpose(2, 3), good_lse),  # head_dim not unit-stride
    ]
    for states in bad:
        with pytest.raises(ValueError, match="merge_with"):
            wrapper.run(batch.q, batch.k_cache, batch.v_cache, merge_with=states)
    scores = torch.zeros(HEADS, int(batch.kv_indptr[-1]) * BLOCK)
    with pytest.raises(ValueError, match="scores_out and merge_with"):
        wrapper.run(batch.q, batch.k_cache, batch.v_cache, scores_out=scores, merge_with=(good_out, good_lse))
