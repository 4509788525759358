"""The batch view of a layer's observed requests: paged keys gathered at once, ring windows at once."""

from __future__ import annotations

import pytest
import torch

from sparse_methods import ModelShape, PagedKeys, QueryRing, build_method
from sparse_methods.deferred_selections import ScoreBatch
from sparse_methods.scoring import reduce_window_probs, window_scores_batch


def _paged(lengths, block_size, seed):
    """A pool holding each request's keys in shuffled blocks, and each request's keys in slot order."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(pages) + 3, generator=g)  # spare blocks: never listed
    k_cache = torch.randn(len(order), block_size, 2, 5, generator=g)
    tables, start = [], 0
    for p in pages:
        tables.append(order[start : start + p].tolist())
        start += p
    width = max(pages)
    table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.int32)
    flat = k_cache.view(-1, 2, 5)
    alone = [
        flat[(torch.tensor(t).view(-1, 1) * block_size + torch.arange(block_size)).view(-1)[:n]]
        for t, n in zip(tables, lengths, strict=True)
    ]
    return PagedKeys(k_cache, table, torch.tensor(lengths), tuple(lengths)), alone


@pytest.mark.parametrize(("lengths", "block_size"), [([23, 40, 31, 9, 1], 8), ([97, 16, 17], 16), ([5, 3], 1)])
def test_paged_keys_dense_is_each_request_padded(lengths, block_size):
    paged, alone = _paged(lengths, block_size, seed=len(lengths))
    dense = paged.dense()
    assert dense.shape == (len(lengths), max(lengths), 2, 5)
    for b, keys in enumerate(alone):
        assert torch.equal(dense[b, : lengths[b]], keys) and not dense[b, lengths[b] :].any()
    picked = [0, 2] if len(lengths) > 2 else [1]
    some = paged.take(picked)
    assert some.kv_lens_cpu == tuple(lengths[i] for i in picked)
    assert torch.equal(some.dense()[:, : max(some.kv_lens_cpu)], dense[picked][:, : max(some.kv_lens_cpu)])
    assert torch.equal(paged.take([1]).dense()[0], alone[1])


def test_paged_values_gather_like_the_keys():
    """A v-cache beside the k-cache (a method that observes values): ``dense_values`` reads it through the same
    tables, also after ``take``; without one it is a clear error."""
    paged, alone = _paged([23, 40, 9], 8, seed=7)
    with pytest.raises(ValueError, match="no values"):
        paged.dense_values()
    v_cache = -2 * paged.k_cache  # values: the keys' pages, transformed
    with_values = PagedKeys(paged.k_cache, paged.block_table, paged.kv_lens, paged.kv_lens_cpu, v_cache)
    assert torch.equal(with_values.dense_values(), -2 * paged.dense())
    assert torch.equal(with_values.take([2]).dense_values()[0], -2 * alone[2])


def test_ring_latest_batch_is_each_requests_latest():
    ring = QueryRing(
        num_layers=2, num_rows=4, window=3, num_heads=2, head_dim=4, max_batch_size=4, dtype=torch.float32, device="cpu"
    )
    g = torch.Generator().manual_seed(0)
    steps = [["a", "b", "c"], ["a", "b", "c"], ["a", None, "c"], ["a", "b", "c"], ["b", "a", "c"]]
    for rids in steps:  # rows wrap past the window, at different counts per request
        ring.plan(rids)
        for layer in range(2):
            ring.record(layer, torch.randn(len(rids), 2, 4, generator=g))
    for layer in range(2):
        batch = ring.latest_batch(["c", "a", "b"], layer)
        expected = torch.stack([ring.latest(rid, layer) for rid in ("c", "a", "b")])
        assert torch.equal(batch, expected)
    ring.clear("b")
    ring.plan(["a", "b"])
    with pytest.raises(ValueError, match="full window"):
        ring.latest_batch(["a", "b"], 0)


def _window_batch(device, seed=3, lengths=(23, 40, 31, 9), n=6, block_size=8):
    paged, _ = _paged(list(lengths), block_size, seed)
    paged = PagedKeys(*(t.to(device) for t in (paged.k_cache, paged.block_table, paged.kv_lens)), paged.kv_lens_cpu)
    queries = torch.randn(len(lengths), n, 6, 5, generator=torch.Generator().manual_seed(seed)).to(device)
    return queries, paged


@pytest.mark.parametrize("pooling", ["max", "avg", "none"])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_window_probs_from_the_pages_give_the_batch_window_scores(pooling, reduce):
    """What SnapKV's ``score_batch`` computes on a GPU (``window_probs`` over the pages, then pooled and
    reduced), with the kernel's reference here: ``window_scores_batch`` over the gathered keys."""
    from sparse_kernels import window_probs

    queries, paged = _window_batch("cpu")
    n, L = queries.shape[1], paged.max_len
    probs = window_probs(queries, paged.k_cache, paged.block_table, paged.kv_lens, 0.3, max_len=L, backend="reference")
    got = reduce_window_probs(probs.view(4, 2, 3, L)[..., : L - n], 5, pooling, reduce)
    kw = dict(kernel_size=5, pooling=pooling, group_reduce=reduce)
    want = window_scores_batch(queries, paged.dense(), paged.kv_lens, 0.3, **kw)
    for b, kv_len in enumerate(paged.kv_lens_cpu):
        torch.testing.assert_close(got[b, :, : kv_len - n], want[b, :, : kv_len - n], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapkv_scores_a_paged_batch_on_the_gpu_like_the_gathered_keys():
    shape = ModelShape(num_layers=1, num_q_heads=6, num_kv_heads=2, head_dim=5)
    method = build_method("snapkv", shape, observation_window_size=6, decode_eviction_interval=8)
    queries, paged = _window_batch("cuda")
    fused = method.score_batch(0, ScoreBatch.of_tensors(list(range(4)), queries, paged, 0.3))
    dense = method.score_batch(0, ScoreBatch.of_tensors(list(range(4)), queries, _on_cpu(paged), 0.3))
    for b, kv_len in enumerate(paged.kv_lens_cpu):
        torch.testing.assert_close(fused[b, :, : kv_len - 6].cpu(), dense[b, :, : kv_len - 6], rtol=1e-4, atol=1e-5)


def _on_cpu(paged: PagedKeys) -> PagedKeys:
    return PagedKeys(*(t.cpu() for t in (paged.k_cache, paged.block_table, paged.kv_lens)), paged.kv_lens_cpu)
