"""The graphed index builder: off CUDA it is ``build_cluster_index``; on CUDA a replay of a shape's graph, fed new
keys and values, equals the eager build of those inputs, shapes above the cap run eagerly, and the graphs kept
stay within their bound."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels.cluster_index import ClusterIndex, build_cluster_index
from sparse_kernels.cluster_index_graphs import GraphedIndexBuilder

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _blocks(seed: int, n: int, heads: int, dim: int, clusters: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys of ``clusters`` random directions per head plus noise, ``n / clusters`` consecutive tokens a
    direction, so each of the k-means' evenly spaced seeds starts in its own direction and every key is nearest
    its own by a wide margin: no assignment is near a tie. (Near ties do not replay alike: CUDA's scatter-add
    sums in no fixed order and library kernels may differ inside a capture, so even two eager builds can split a
    tied key differently.)"""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(heads, clusters, dim, generator=g)
    which = (torch.arange(n) * clusters // n).expand(heads, n)
    keys = directions.gather(1, which.unsqueeze(-1).expand(-1, -1, dim)) * 4
    keys = keys + 0.1 * torch.randn(heads, n, dim, generator=g)
    values = torch.randn(n, heads, dim, generator=g)
    return keys.transpose(0, 1).to(device), values.to(device, torch.bfloat16)


def _assert_same(got: ClusterIndex, want: ClusterIndex) -> None:
    assert (got.start, got.end) == (want.start, want.end)
    assert torch.equal(got.sizes, want.sizes)
    assert torch.equal(got.offsets, want.offsets)
    assert torch.equal(got.sorted_positions, want.sorted_positions)
    torch.testing.assert_close(got.centroids.float(), want.centroids.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.value_sums, want.value_sums, atol=1e-3, rtol=1e-4)


def test_cpu_builds_eagerly():
    keys, values = _blocks(0, 64, 3, 16, 4, "cpu")
    builder = GraphedIndexBuilder()
    got = builder(keys, values, avg_cluster_size=8, segments=1)
    _assert_same(got, build_cluster_index(keys, values, start=0, avg_cluster_size=8, segments=1))
    assert (builder.captures, builder.replays) == (0, 0)


@pytest.mark.gpu
@CUDA
def test_replays_equal_the_eager_build_of_new_inputs():
    builder = GraphedIndexBuilder()
    outs = []
    for seed in range(3):  # one capture, then replays fed new keys and values
        keys, values = _blocks(seed, 256, 16, 128, 16, "cuda")
        got = builder(keys, values, avg_cluster_size=16, segments=1)
        want = build_cluster_index(keys, values, start=0, avg_cluster_size=16, segments=1)
        _assert_same(got, want)
        outs.append(got.centroids.clone())
        keys_only = builder(keys, None, avg_cluster_size=16, segments=1)  # a second shape key: no values
        assert keys_only.value_sums is None and torch.equal(keys_only.sorted_positions, want.sorted_positions)
    assert (builder.captures, builder.replays) == (2, 6)
    assert not torch.equal(outs[0], outs[1])  # the replays did see the new inputs


@pytest.mark.gpu
@CUDA
def test_large_shapes_run_eagerly_and_graphs_stay_bounded():
    builder = GraphedIndexBuilder(max_token_heads=256 * 8, max_graphs=2)
    keys, values = _blocks(0, 256, 16, 64, 16, "cuda")  # 256 x 16 token-heads: above the cap
    _assert_same(builder(keys, values, avg_cluster_size=16, segments=1),
                 build_cluster_index(keys, values, start=0, avg_cluster_size=16, segments=1))  # fmt: skip
    assert builder.captures == 0
    for heads in (2, 4, 8, 2):
        keys, values = _blocks(heads, 256, heads, 64, 16, "cuda")
        _assert_same(builder(keys, values, avg_cluster_size=16, segments=1),
                     build_cluster_index(keys, values, start=0, avg_cluster_size=16, segments=1))  # fmt: skip
    assert builder.captures == 4  # heads 2 was dropped by 4 and 8 (two graphs kept) and captured again
    assert len(builder._graphs) == 2
