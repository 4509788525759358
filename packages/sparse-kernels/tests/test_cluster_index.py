"""RetroInfer's cluster index and decode attention: k-means equals a per-token loop on fixed seeds,
every cluster retrieved equals dense attention, and estimated clusters of identical keys are exact."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels.cluster_attention import budget_positions, cluster_counts, cluster_decode_attention, rank_clusters
from sparse_kernels.cluster_index import build_cluster_index, concat_indexes


def _best(key, centres):
    """The centre of highest dot product with ``key``, the first on ties."""
    scores = [float(key @ c) for c in centres]
    return max(range(len(centres)), key=lambda j: (scores[j], -j))


def _loop_index(keys, values, *, start, avg, segments, rounds):
    """The index of one KV head at a time, token by token, cluster by cluster."""
    n, heads, _ = keys.shape
    count = (n // avg // segments) * segments
    per = count // segments
    out = {"assign": [], "centroids": [], "value_sums": [], "sizes": [], "positions": []}
    for h in range(heads):
        x = keys[:, h].double()
        mean = sum(x[t] for t in range(n)) / n
        unit = [(x[t] - mean) / (x[t] - mean).norm() for t in range(n)]

        centres = []
        for s in range(segments):
            lo, hi = s * n // segments, (s + 1) * n // segments
            seg = [unit[lo + int((i + 0.5) * (hi - lo) / per)] for i in range(per)]
            for _ in range(rounds):
                members = [[] for _ in range(per)]
                for t in range(lo, hi):
                    members[_best(unit[t], seg)].append(t)
                for j in range(per):
                    if members[j]:
                        m = sum(unit[t] for t in members[j]) / len(members[j])
                        seg[j] = m / m.norm()
            centres += seg
        assign = [_best(unit[t], centres) for t in range(n)]
        members = [[t for t in range(n) if assign[t] == c] for c in range(count)]
        out["assign"].append(assign)
        out["sizes"].append([len(m) for m in members])
        out["centroids"].append([(sum(x[t] - mean for t in m) / len(m) + mean) if m else mean for m in members])
        out["value_sums"].append([sum((values[t, h].double() for t in m), torch.zeros(keys.shape[2])) for m in members])
        out["positions"].append([start + t for m in members for t in m])
    return out


@pytest.mark.parametrize(("n", "avg", "segments", "seed"), [(96, 8, 1, 0), (100, 8, 2, 1), (64, 4, None, 2)])
def test_index_equals_loop(n, avg, segments, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, 2, 8, generator=gen) + torch.randn(1, 2, 8, generator=gen)
    values = torch.randn(n, 2, 8, generator=gen)
    index = build_cluster_index(keys, values, start=5, avg_cluster_size=avg, segments=segments, rounds=3)
    want = _loop_index(keys, values, start=5, avg=avg, segments=segments or 1, rounds=3)
    assert index.start == 5 and index.end == 5 + n
    assert index.sizes.tolist() == want["sizes"]
    assert index.sorted_positions.tolist() == want["positions"]
    torch.testing.assert_close(index.offsets, torch.cumsum(index.sizes.long(), 1) - index.sizes.long())
    for h in range(2):
        torch.testing.assert_close(index.centroids[h].double(), torch.stack(want["centroids"][h]), atol=1e-5, rtol=0)
        torch.testing.assert_close(index.value_sums[h].double(), torch.stack(want["value_sums"][h]), atol=1e-5, rtol=0)


def test_counts():
    assert cluster_counts(1000, 0.018, 0.232) == (18, 232)
    assert cluster_counts(10, 0.01, 0.5) == (1, 5)
    assert cluster_counts(10, 1.0, 0.5) == (10, 0)
    assert cluster_counts(10, 0.9, 0.5) == (9, 1)


def _dense(query, keys, values, scale):
    group = query.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", query.float(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", p, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_clusters_retrieved_is_dense(dtype):
    gen = torch.Generator().manual_seed(3)
    kv_len, sink, heads, dim = 150, 4, 2, 16
    keys = torch.randn(kv_len, heads, dim, generator=gen).to(dtype)
    values = torch.randn(kv_len, heads, dim, generator=gen).to(dtype)
    query = torch.randn(6, dim, generator=gen).to(dtype)
    first = build_cluster_index(keys[sink:100], values[sink:100], start=sink, avg_cluster_size=8)
    block = build_cluster_index(keys[100:132], values[100:132], start=100, avg_cluster_size=8, segments=1)
    index = concat_indexes(first, block)
    assert sorted(index.sorted_positions[1].tolist()) == list(range(sink, 132))
    out = cluster_decode_attention(
        query, keys, values, index, sink=sink, retrieved=index.num_clusters, estimated=0, scale=dim**-0.5
    )
    torch.testing.assert_close(
        out.float(), _dense(query, keys, values, dim**-0.5), atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=0
    )


def test_estimated_clusters_of_identical_keys_are_exact():
    """Groups of ``avg`` identical keys each form one cluster whose centroid is their key, so
    estimating them (size * exp(q.c), value sums) is exact; only sink, tail and one cluster are read."""
    gen = torch.Generator().manual_seed(4)
    sink, groups, avg, heads, dim = 4, 12, 8, 2, 16
    distinct = torch.randn(groups, heads, dim, generator=gen, dtype=torch.float64)
    middle = distinct.repeat_interleave(avg, dim=0)
    keys = torch.cat(
        [
            torch.randn(sink, heads, dim, generator=gen, dtype=torch.float64),
            middle,
            torch.randn(5, heads, dim, generator=gen, dtype=torch.float64),
        ]
    )
    values = torch.randn(keys.shape, generator=gen, dtype=torch.float64)
    query = torch.randn(4, dim, generator=gen, dtype=torch.float64)
    index = build_cluster_index(
        keys[sink : sink + groups * avg], values[sink : sink + groups * avg], start=sink, avg_cluster_size=avg
    )
    assert (index.sizes == avg).all()
    out = cluster_decode_attention(query, keys, values, index, sink=sink, retrieved=1, estimated=groups - 1, scale=0.3)
    torch.testing.assert_close(out, _dense(query, keys, values, 0.3).double(), atol=1e-5, rtol=0)
    partial = cluster_decode_attention(query, keys, values, index, sink=sink, retrieved=1, estimated=2, scale=0.3)
    assert not torch.allclose(partial, out)  # omitted clusters do change the output


def test_a_token_budget_reads_clusters_in_rank_order():
    """A budget at the retrieved clusters' boundary reads them whole; a budget of every cluster token with every
    cluster retrieved is dense; one token short of the boundary leaves the last cluster's final token out
    (neither read nor estimated), and fewer retrieved clusters than the budget reaches estimate the rest: both
    change the output. One KV head (a budget's clusters differ per head)."""
    gen = torch.Generator().manual_seed(6)
    sink, avg, dim, n = 4, 8, 16, 96
    keys = torch.randn(sink + n + 7, 1, dim, generator=gen, dtype=torch.float64)
    values = torch.randn(keys.shape, generator=gen, dtype=torch.float64)
    query = torch.randn(4, dim, generator=gen, dtype=torch.float64)
    index = build_cluster_index(keys[sink : sink + n], values[sink : sink + n], start=sink, avg_cluster_size=avg)
    kw = dict(sink=sink, scale=0.3)
    ranked = rank_clusters(query, index, 0.3, index.num_clusters)[0]
    first = int(index.sizes[0, ranked[:3]].sum())
    positions, reached = budget_positions(index, ranked, 0, first)
    assert reached == 3 and torch.equal(positions, index.cluster_positions(0, ranked[:3]))
    short, reached = budget_positions(index, ranked, 0, first - 1)
    assert reached == 3 and short.numel() == first - 1
    whole = cluster_decode_attention(query, keys, values, index, retrieved=3, estimated=4, **kw)
    budget = cluster_decode_attention(query, keys, values, index, retrieved=3, estimated=4, budget=first, **kw)
    torch.testing.assert_close(budget, whole, atol=1e-6, rtol=0)  # the estimated summed in another order
    cut = cluster_decode_attention(query, keys, values, index, retrieved=3, estimated=4, budget=first - 1, **kw)
    assert not torch.allclose(cut, whole)
    fewer = cluster_decode_attention(query, keys, values, index, retrieved=2, estimated=5, budget=first, **kw)
    assert not torch.allclose(fewer, whole)  # the budget reaches a third cluster, but only two are retrieved
    count = index.num_clusters
    every = cluster_decode_attention(query, keys, values, index, retrieved=count, estimated=0, budget=n, **kw)
    torch.testing.assert_close(every, _dense(query, keys, values, 0.3).double(), atol=1e-6, rtol=0)  # float32 inside


def test_ranking_skips_empty_clusters():
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(64, 1, 8, generator=gen)
    keys[:32] = keys[0]  # many identical keys: their seeds' clusters collapse into one, others stay empty
    index = build_cluster_index(keys, None, start=0, avg_cluster_size=4)
    empty = (index.sizes[0] == 0).nonzero().flatten()
    assert empty.numel() > 0
    nonempty = int((index.sizes[0] > 0).sum())
    ranked = rank_clusters(torch.randn(2, 8, generator=gen), index, 1.0, nonempty)
    assert not set(ranked[0].tolist()) & set(empty.tolist())
