"""Cascade prefill: the cached prefix's whole pages by a dense attention, the rest by the paged Triton
kernel with its log-sum-exp, merged: equal to the one-pass paged attention.

On CPU the split runs with the prefix part's plain formula (``SPLIT_WITHOUT_FUSED``) and thresholds
lowered to the test's sizes; on CUDA in bf16 the prefix part is cuDNN's fused attention, checked at 32K
against torch SDPA on contiguous K/V.
"""

from __future__ import annotations

import pytest
import torch

from sparse_kernels import BatchPrefillWithPagedKVCache, prefix_attention
from sparse_kernels.merge_states import merge_states_
from sparse_kernels.prefix_attention import attention_with_lse, prefix_pages

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _plain(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("thd,nhd->htn", q.double(), k.double().repeat_interleave(group, 1)) * scale
    return torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v.double().repeat_interleave(group, 1)), s.logsumexp(-1).T


def test_attention_with_lse_matches_plain_formula():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 32, generator=g) for n, h in ((7, 8), (19, 2), (19, 2)))
    out, lse = attention_with_lse(q, k, v, 0.3)
    ref, ref_lse = _plain(q, k, v, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_of_two_key_sets_equals_attention_over_both():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 16, generator=g)
    k, v = torch.randn(30, 2, 16, generator=g), torch.randn(30, 2, 16, generator=g)
    out, lse = attention_with_lse(q, k[:11], v[:11], 0.25)
    other, other_lse = attention_with_lse(q, k[11:], v[11:], 0.25)
    want = _plain(q, k, v, 0.25)[0]
    # Into a third tensor: both states stay as they were.
    before, dst = out.clone(), torch.empty_like(out)
    assert merge_states_(out, lse, other, other_lse, out=dst) is dst
    torch.testing.assert_close(dst.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out, before)
    with pytest.raises(ValueError, match="share a shape"):
        merge_states_(out, lse, other, other_lse, out=dst[:3])
    merge_states_(out, lse, other, other_lse)  # in place
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.fixture
def small_split(monkeypatch):
    """The split at the tests' sizes, off CUDA too: prefix steps of one 16-token page, chunks of 2 queries and up."""
    monkeypatch.setattr(prefix_attention, "SPLIT_WITHOUT_FUSED", True)
    monkeypatch.setattr(prefix_attention, "CASCADE_PREFIX_STEP", 16)
    monkeypatch.setattr(prefix_attention, "CASCADE_MIN_QUERIES", 2)


def test_causal_square_matches_the_masked_formula(monkeypatch):
    monkeypatch.setattr(prefix_attention, "CASCADE_MIN_QUERIES", 4)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(8, h, 16, generator=g) for h in (4, 2, 2))
    out, lse = attention_with_lse(q, k, v, 0.4, causal=True)
    for i in range(8):  # query i over keys 0..i, each row alone through the unmasked formula
        ref, ref_lse = _plain(q[i : i + 1], k[: i + 1], v[: i + 1], 0.4)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[i : i + 1].double(), ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="square"):
        attention_with_lse(q[:6], k[:6], v[:6], 0.4, causal=True)  # not a bucket's size: shapes would not repeat
    with pytest.raises(ValueError, match="square"):
        attention_with_lse(q, torch.cat([k, k]), torch.cat([v, v]), 0.4, causal=True)


def test_squares_are_whole_page_chunks_of_a_bucket_size(monkeypatch):
    monkeypatch.setattr(prefix_attention, "CASCADE_MIN_QUERIES", 4)
    qo = torch.tensor([16, 32, 16, 8, 1, 64])
    kv = torch.tensor([16, 64, 36, 24, 40, 64])
    pages = torch.tensor([0, 2, 1, 1, 0, 1])
    # A: a first chunk; B: after 2 prefix pages; C: 20 keys left for 16 queries; D: half a page; E: a decode row;
    # F: 48 keys left for 64 queries.
    assert prefix_attention.squares(qo, kv, pages, 16).tolist() == [True, True, False, False, False, False]
    monkeypatch.setattr(prefix_attention, "CASCADE_SQUARES", False)
    assert not prefix_attention.squares(qo, kv, pages, 16).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused_squares", [True, False])
def test_split_with_causal_squares_equals_one_pass(
    small_split, paged_batch, triton_device, monkeypatch, dtype, fused_squares
):
    monkeypatch.setattr(prefix_attention, "CASCADE_SQUARES", fused_squares)
    # A first chunk of 16 (a square alone), 32 after a 32-token prefix (square + prefix), 16 after 20 (prefix +
    # paged rest), a decode row, 8 queries after 16 (half a page: paged rest).
    qo_lens, kv_lens = [16, 32, 16, 1, 8], [16, 64, 36, 40, 24]
    batch = paged_batch(
        qo_lens, kv_lens, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, seed=7
    ).to(triton_device)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper)
    rest, requests = wrapper._split
    shape = [
        (lo, None if prefix is None else prefix[1], None if own is None else own[1]) for lo, _, prefix, own in requests
    ]
    if fused_squares:
        assert shape == [(0, None, 1), (16, 2, 2), (48, 1, None), (65, 1, None)]
    else:
        assert shape == [(16, 2, None), (48, 1, None), (65, 1, None)]
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[dtype])


def test_split_of_squares_only_launches_no_paged_kernel(small_split, paged_batch, triton_device, monkeypatch):
    batch = paged_batch([32, 16], [32 + 48, 16], block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, seed=8).to(
        triton_device
    )
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper)
    rest, requests = wrapper._split
    assert rest is None and [own[1] for *_, own in requests] == [2, 1]
    torch.testing.assert_close(
        wrapper.run(batch.q, batch.k_cache, batch.v_cache).cpu(), batch.reference(), **TOL[torch.float32]
    )


def test_no_cascade_keeps_every_request_in_the_paged_kernel(small_split, paged_batch, triton_device):
    """``cascade=False`` (a head-major store's lanes): the same layout plans no split and gives the same output."""
    batch = paged_batch(
        [16, 32, 16], [16, 64, 36], block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, seed=9
    ).to(triton_device)
    split = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(split)
    assert split._split is not None  # the layout splits when allowed
    whole = BatchPrefillWithPagedKVCache(triton_device, backend="triton", cascade=False)
    batch.plan_prefill(whole)
    assert whole._split is None
    got = whole.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(got.cpu(), batch.reference(), **TOL[torch.float32])
    torch.testing.assert_close(got, split.run(batch.q, batch.k_cache, batch.v_cache), **TOL[torch.float32])


def test_prefix_pages_takes_whole_pages_of_long_prefixes_only(monkeypatch):
    monkeypatch.setattr(prefix_attention, "CASCADE_PREFIX_STEP", 32)
    monkeypatch.setattr(prefix_attention, "CASCADE_MIN_QUERIES", 4)
    qo = torch.tensor([4, 4, 3, 10, 5])
    kv = torch.tensor([4 + 40, 4 + 31, 3 + 100, 10 + 32, 5 + 95])
    # Whole steps of 32 tokens only (95 -> 64 = 4 pages, the rest to the paged kernel): shapes repeat.
    assert prefix_pages(qo, kv, 16).tolist() == [2, 0, 0, 2, 4]


def test_query_bucket_pads_to_powers_of_two(monkeypatch):
    monkeypatch.setattr(prefix_attention, "CASCADE_MIN_QUERIES", 4)
    assert [prefix_attention.query_bucket(n) for n in (1, 4, 5, 8, 9, 2048, 2049)] == [4, 4, 8, 8, 16, 2048, 4096]


def test_warm_plans_builds_nothing_where_the_fused_attention_does_not_run():
    step = prefix_attention.CASCADE_PREFIX_STEP
    # Off CUDA there is no cuDNN plan to build; on any device a chunk too short to split, or a prompt shorter
    # than one step, needs none.
    assert prefix_attention.warm_plans(2048, 64 * step, 32, 8, 128, torch.bfloat16, "cpu") == 0
    assert (
        prefix_attention.warm_plans(
            prefix_attention.CASCADE_MIN_QUERIES - 1, 64 * step, 8, 2, 64, torch.bfloat16, "cpu"
        )
        == 0
    )
    assert prefix_attention.warm_plans(2048, step - 1, 8, 2, 64, torch.bfloat16, "cpu") == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_plans_builds_one_plan_per_prefix_step_on_cuda():
    step = prefix_attention.CASCADE_PREFIX_STEP
    squares = 2  # causal squares of 128 and 256 rows (CASCADE_MIN_QUERIES 128)
    assert prefix_attention.warm_plans(256, 5 * step + 7, 8, 2, 64, torch.bfloat16, "cuda") == 5 + squares
    assert prefix_attention.warm_plans(256, 100 * step, 8, 2, 64, torch.bfloat16, "cuda", max_shapes=3) == 3 + squares


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_prefill_equals_one_pass(small_split, paged_batch, triton_device, monkeypatch, dtype):
    # Prefixes of 0, 1 page + a partial page, 3 pages exactly; one request too short to split.
    qo_lens, kv_lens = [20, 9, 33, 1], [20, 9 + 27, 33 + 48, 60]
    batch = paged_batch(
        qo_lens, kv_lens, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, seed=5
    ).to(triton_device)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper)
    rest, requests = wrapper._split
    assert [(lo, prefix[1], own) for lo, _, prefix, own in requests] == [(20, 1, None), (29, 3, None)]
    out = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out.cpu(), batch.reference(), **TOL[dtype])


def test_split_reads_an_ascending_page_run_in_place(small_split, paged_batch, triton_device, monkeypatch):
    batch = paged_batch(
        [9, 33], [9 + 27, 33 + 48], block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=32, seed=6
    ).to(triton_device)
    # Renumber the second request's pages so its 3 prefix pages are one ascending run of pool blocks.
    lo, hi = int(batch.kv_indptr[1]), int(batch.kv_indptr[2])
    order = batch.kv_indices[lo:hi].long()
    base = batch.k_cache.shape[0]
    for cache in ("k_cache", "v_cache"):
        old = getattr(batch, cache)
        setattr(batch, cache, torch.cat([old, old[order.to(old.device)]]))
    batch.kv_indices[lo:hi] = torch.arange(base, base + hi - lo, dtype=torch.int32)
    wrapper = BatchPrefillWithPagedKVCache(triton_device, backend="triton")
    batch.plan_prefill(wrapper)
    runs = [prefix[2] for _, _, prefix, _ in wrapper._split[1]]
    assert runs[1] == base and (runs[0] == -1 or runs[0] >= 0)
    torch.testing.assert_close(
        wrapper.run(batch.q, batch.k_cache, batch.v_cache).cpu(), batch.reference(), **TOL[torch.float32]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("chunk", [(30720, 32768), (0, 8192), (30000, 32768)])
def test_split_prefill_32k_against_sdpa_on_cuda(chunk):
    import torch.nn.functional as F

    lo, hi = chunk
    hq, hkv, d, bs = 32, 8, 128, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = hi // bs
    perm = torch.randperm(pages, device="cuda", generator=g)
    k_cache = torch.randn(pages, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(pages, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(hi - lo, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    wrapper = BatchPrefillWithPagedKVCache("cuda", backend="triton")
    wrapper.plan(
        torch.tensor([0, hi - lo], dtype=torch.int32),
        torch.tensor([0, pages], dtype=torch.int32),
        perm.int().cpu(),
        torch.tensor([bs], dtype=torch.int32),
        num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
    )  # fmt: skip
    rest, requests = wrapper._split
    # 2048 queries after 15 whole steps, and a first chunk of 8192: causal squares (no paged kernel); 2768 queries
    # after 30000 tokens: the paged kernel reads the rest.
    assert (rest is None) == (lo != 30000) and (requests[0][3] is not None) == (lo != 30000)
    out = wrapper.run(q, k_cache, v_cache)
    k, v = (c[perm].reshape(hi, hkv, d).transpose(0, 1)[None].float() for c in (k_cache, v_cache))
    mask = torch.arange(hi, device="cuda")[None, :] <= torch.arange(lo, hi, device="cuda")[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.float(), ref[0].transpose(0, 1), atol=2e-2, rtol=2e-2)
