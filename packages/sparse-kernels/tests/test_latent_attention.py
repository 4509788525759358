"""Latent (MLA) paged attention: Triton == reference == a per-request oracle, decode and prefill, and
the graph-safe decode (``BatchLatentDecode``) over fixed buffers that later plans of the same batch
size reuse in place (a one-token request, more heads than one tile holds, splits that short requests
leave unused).

Runs natively on CUDA where present, else under Triton's interpreter on CPU at small sizes. The
oracle is written here from the definition (scores over ``[c_kv | k_rope]``, values ``c_kv``), not
through the package's reference.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels.latent_attention import latent_attention, merge_splits, plan_latent, store_latent
from sparse_kernels.latent_decode import BatchLatentDecode

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _paged(kv_lens, block_size, dim, dtype, seed):
    """A shuffled pool holding each request's rows, and its CSR tables."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=g)[: sum(pages)].to(torch.int32)
    cache = torch.randn(num_blocks, block_size, 1, dim, generator=g).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * block_size for n, p in zip(kv_lens, pages, strict=True)], dtype=torch.int32)
    return cache, indptr, order, last


def _oracle(q, cache, qo_lens, kv_lens, indptr, indices, block_size, latent, scale):
    out, start = [], 0
    for b, (n, kv_len) in enumerate(zip(qo_lens, kv_lens, strict=True)):
        blocks = indices[indptr[b] : indptr[b + 1]].long()
        rows = cache[blocks].flatten(0, 2)[:kv_len].float()  # [L, D]
        qb = q[start : start + n].float()  # [n, H, D]
        scores = torch.einsum("nhd,ld->hnl", qb, rows) * scale
        pos = torch.arange(kv_len - n, kv_len)[:, None]
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > pos, float("-inf"))
        out.append(torch.einsum("hnl,lc->nhc", scores.softmax(-1), rows[:, :latent]))
        start += n
    return torch.cat(out).to(q.dtype)


# (qo_lens, kv_lens, block_size, heads, latent, rope, dtype, splits)
CASES = {
    "decode-b5-bs16-fp32": ([1] * 5, [1, 97, 16, 17, 40], 16, 4, 32, 16, torch.float32, None),
    "decode-b3-bs1-splits-fp32": ([1] * 3, [1, 70, 33], 1, 3, 24, 8, torch.float32, 4),
    "decode-b2-bs16-splits-bf16": ([1] * 2, [97, 5], 16, 20, 32, 16, torch.bfloat16, 3),
    "prefill-prefix-bs16-fp32": ([5, 1, 13], [37, 1, 13], 16, 4, 32, 16, torch.float32, None),
    "prefill-bs8-heads5-fp32": ([9, 3], [9, 20], 8, 5, 16, 16, torch.float32, None),
    "prefill-splits-bf16": ([7, 2], [50, 2], 16, 3, 32, 16, torch.bfloat16, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_latent_attention_triton_and_reference_match_oracle(triton_device, case):
    qo_lens, kv_lens, bs, heads, latent, rope, dtype, splits = CASES[case]
    cache, indptr, indices, last = _paged(kv_lens, bs, latent + rope, dtype, seed=len(case))
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(qo_lens), heads, latent + rope, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = 0.7 * (latent + rope) ** -0.5
    expected = _oracle(q, cache, qo_lens, kv_lens, indptr, indices, bs, latent, scale)
    shape = dict(num_heads=heads, latent_dim=latent, rope_dim=rope, block_size=bs, sm_scale=scale)
    ref_plan = plan_latent(qo_indptr, indptr, indices, last, device="cpu", num_splits=splits, **shape)
    torch.testing.assert_close(latent_attention(q, cache, ref_plan, backend="reference"), expected, **TOL[dtype])
    plan = plan_latent(qo_indptr, indptr, indices, last, device=triton_device, num_splits=splits, **shape)
    out = torch.full((q.shape[0], heads, latent), float("nan"), dtype=dtype, device=triton_device)
    got = latent_attention(q.to(triton_device), cache.to(triton_device), plan, out=out, backend="triton")
    assert got is out
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])


def test_merge_splits_ignores_splits_that_saw_no_key():
    o = torch.tensor([[[1.0, 2.0], [5.0, 5.0], [3.0, 4.0]]])
    lse = torch.tensor([[0.0, float("-inf"), 1.0]])  # base 2: weights 1 and 2
    torch.testing.assert_close(merge_splits(o, lse), torch.tensor([[7.0 / 3, 10.0 / 3]]))


def test_triton_merge_equals_merge_splits(triton_device):
    """The one-launch merge weighs the splits as the plain one, dead splits (NaN partials) left unread,
    and writes each (token, head) row through out's strides."""
    from sparse_kernels._triton.latent_attention import latent_merge_kernel

    g = torch.Generator().manual_seed(0)
    tokens, heads, splits, latent = 3, 5, 6, 24
    o_part = torch.randn(tokens * heads, splits, latent, generator=g)
    lse = torch.randn(tokens * heads, splits, generator=g) * 4
    dead = torch.rand(tokens * heads, splits, generator=g) < 0.4
    dead[:, 0] = False  # every row saw some key
    lse[dead], o_part[dead] = float("-inf"), float("nan")
    expected = merge_splits(o_part.nan_to_num(), lse).view(tokens, heads, latent)
    out = torch.full((tokens, heads + 2, latent), float("nan"), device=triton_device)[:, 1:-1]  # strided
    latent_merge_kernel[(tokens * heads, 2)](  # two column blocks, the splits in two steps
        o_part.to(triton_device), lse.to(triton_device), out, out.stride(0), out.stride(1), splits,
        NUM_HEADS=heads, LATENT=latent, BLOCK_S=4, BLOCK_C=16,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected)


def test_store_latent_writes_rows_and_skips_padding():
    cache = torch.zeros(3, 4, 1, 6)
    rows = torch.randn(3, 1, 6)
    store_latent(rows, cache, torch.tensor([5, -1, 0], dtype=torch.int32), backend="reference")
    flat = cache.view(-1, 1, 6)
    torch.testing.assert_close(flat[5], rows[0])
    torch.testing.assert_close(flat[0], rows[2])
    assert flat[[1, 2, 3, 4, 6, 7, 8, 9, 10, 11]].abs().sum() == 0


# (kv_lens, block_size, heads, latent, rope, dtype, tiles)
DECODE_CASES = {
    "b5-bs16-fp32": ([1, 97, 16, 17, 40], 16, 4, 32, 16, torch.float32, None),
    "b3-bs1-short-splits-fp32": ([1, 70, 33], 1, 3, 24, 8, torch.float32, {"min_split_keys": 8}),
    "b2-heads70-bf16": ([97, 5], 16, 70, 32, 16, torch.bfloat16, {"min_split_keys": 16, "block_n": 16}),
    "b4-heads20-rows16-bf16": ([3, 50, 16, 1], 16, 20, 32, 16, torch.bfloat16, {"block_m": 16, "min_split_keys": 8}),
}


def _step(kv_lens, bs, heads, latent, rope, dtype, seed):
    cache, indptr, indices, last = _paged(kv_lens, bs, latent + rope, dtype, seed=seed)
    q = torch.randn(len(kv_lens), heads, latent + rope, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return cache, indptr, indices, last, q


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_over_fixed_buffers_matches_oracle(triton_device, case):
    kv_lens, bs, heads, latent, rope, dtype, tiles = DECODE_CASES[case]
    scale = 0.7 * (latent + rope) ** -0.5
    shape = dict(num_heads=heads, latent_dim=latent, rope_dim=rope, block_size=bs)
    wrappers = {
        "reference": BatchLatentDecode("cpu", backend="reference", **shape),
        "triton": BatchLatentDecode(triton_device, max_batch_size=8, max_num_pages=256, backend="triton", **shape),
    }
    addresses = None
    for seed in (0, 1):  # a second step of the same batch size: other lengths, same buffers
        lens = [max(1, n - 7 * seed) for n in kv_lens]
        cache, indptr, indices, last, q = _step(lens, bs, heads, latent, rope, dtype, seed)
        expected = _oracle(q, cache, [1] * len(lens), lens, indptr, indices, bs, latent, scale)
        for wrapper in wrappers.values():
            dev = wrapper.device
            plan = wrapper.plan(indptr, indices, last, sm_scale=scale, tiles=tiles)
            assert plan.decode and plan.num_tiles == len(lens) * -(-heads // plan.block_m)
            out = torch.full((len(lens), heads, latent), float("nan"), dtype=dtype, device=dev)
            got = wrapper.run(q.to(dev), cache.to(dev), out=out)
            assert got is out
            torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])
        plan = wrappers["triton"].planned
        now = (plan.kv_indptr.data_ptr(), plan.kv_indices.data_ptr(), plan.kv_last_len.data_ptr(), plan.num_splits)
        assert addresses in (None, now)  # what a captured launch reads did not move
        addresses = now


def test_decode_buffers_refuse_a_batch_over_capacity():
    wrapper = BatchLatentDecode("cpu", num_heads=2, latent_dim=8, rope_dim=8, block_size=4, max_batch_size=2)
    indptr, indices = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.arange(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="capacity"):
        wrapper.plan(indptr, indices, torch.ones(3, dtype=torch.int32), sm_scale=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_captured_in_a_cuda_graph_replays_later_plans():
    """A ``run`` captured once replays each later plan of the same batch size (other lengths, other
    pages, another split usage) with the oracle's output."""
    heads, latent, rope, bs, dtype = 20, 64, 32, 16, torch.bfloat16
    scale = (latent + rope) ** -0.5
    wrapper = BatchLatentDecode(
        "cuda", num_heads=heads, latent_dim=latent, rope_dim=rope, block_size=bs, max_batch_size=4, max_num_pages=64
    )
    cache = torch.randn(64, bs, 1, latent + rope, dtype=dtype, device="cuda")
    q = torch.empty(3, heads, latent + rope, dtype=dtype, device="cuda")
    out = torch.empty(3, heads, latent, dtype=dtype, device="cuda")
    graph = None
    for seed, lens in enumerate(([5, 300, 17], [290, 1, 64], [33, 33, 700])):
        g = torch.Generator().manual_seed(seed)
        pages = [-(-n // bs) for n in lens]
        indices = torch.randperm(64, generator=g)[: sum(pages)].to(torch.int32)
        indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * bs for n, p in zip(lens, pages, strict=True)], dtype=torch.int32)
        q.copy_(torch.randn(q.shape, generator=g).to(dtype))
        wrapper.plan(indptr, indices, last, sm_scale=scale, tiles={"min_split_keys": 32})
        if graph is None:
            wrapper.run(q, cache, out=out)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wrapper.run(q, cache, out=out)
        graph.replay()
        expected = _oracle(q.cpu(), cache.cpu(), [1] * 3, lens, indptr, indices, bs, latent, scale)
        torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])
