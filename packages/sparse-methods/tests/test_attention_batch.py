"""The batch view of a layer's observed requests: paged keys gathered at once, ring windows at once."""

from __future__ import annotations

import pytest
import torch

from sparse_methods import PagedKeys, QueryRing


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
