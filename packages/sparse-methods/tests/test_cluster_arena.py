"""The cluster arena: a request's index (value sums included) lands in its own row, an appended block is
written in place beside what is there (equal to writing the grown index whole, and read back as it), rows are
given back and reused, and nothing past the planned capacity is accepted."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels.cluster_index import build_cluster_index, concat_indexes
from sparse_methods import ClusterArena

HEADS, DIM = 2, 8


def _arena(rows: int = 3, tokens: int = 64, clusters: int = 16) -> ClusterArena:
    return ClusterArena(2, rows, tokens, clusters, HEADS, DIM, torch.float32, "cpu", plan_rows=4)


def _row(arena: ClusterArena, rid, layer: int, index) -> tuple[torch.Tensor, ...]:
    t0, c0 = arena.bases(rid)
    c1, t1 = c0 + index.num_clusters, t0 + index.sorted_positions.shape[1]
    centroids, sizes, offsets, positions, value_sums = arena.layers[layer]
    return centroids[:, c0:c1], sizes[:, c0:c1], offsets[:, c0:c1], positions[:, t0:t1], value_sums[:, c0:c1]


def _expected(index) -> tuple[torch.Tensor, ...]:
    return index.centroids, index.sizes, index.offsets.to(torch.int32), index.sorted_positions, index.value_sums


def test_appended_block_written_in_place_equals_the_whole_index():
    keys, values = torch.randn(2, 40, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    first = build_cluster_index(keys[2:26], values[2:26], start=2, avg_cluster_size=4)
    block = build_cluster_index(keys[26:34], values[26:34], start=26, avg_cluster_size=4, segments=1)
    grown = concat_indexes(first, block)
    arena, whole = _arena(), _arena()
    pointers = [t.data_ptr() for layer in arena.layers for t in layer]
    arena.write("a", 0, first)
    arena.write("b", 1, first)  # another request: the next row
    arena.write("b", 1, block, at_cluster=first.num_clusters, at_token=first.sorted_positions.shape[1])
    whole.write("x", 0, first)
    whole.write("b", 1, grown)
    assert arena.bases("b") == (64, 16) and whole.bases("b") == (64, 16)
    for got, want in zip(_row(arena, "b", 1, grown), _expected(grown), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(_row(arena, "a", 0, first), _expected(first), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(arena.layers[1], whole.layers[1], strict=True):
        assert torch.equal(got, want)
    assert [t.data_ptr() for layer in arena.layers for t in layer] == pointers
    read = arena.read("b", 1, grown.start, grown.end, grown.num_clusters)
    for name in ("centroids", "value_sums", "sizes", "offsets", "sorted_positions"):
        assert torch.equal(getattr(read, name), getattr(grown, name)), name
    assert (read.start, read.end) == (grown.start, grown.end)
    assert arena.read("b", 1, grown.start, grown.end, grown.num_clusters, values=False).value_sums is None
    arena.release("a")
    arena.write("c", 0, first)
    assert arena.bases("c") == (0, 0)  # the lowest free row again


def test_capacity_is_refused_past_its_plan():
    keys = torch.randn(40, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    index = build_cluster_index(keys, None, start=0, avg_cluster_size=4)  # 10 clusters over 40 tokens
    with pytest.raises(ValueError, match="outgrows its arena row"):
        _arena(tokens=32).write("a", 0, index)
    with pytest.raises(ValueError, match="outgrows its arena row"):
        _arena(clusters=8).write("a", 0, index)
    arena = _arena(rows=1)
    arena.write("a", 0, index)
    with pytest.raises(RuntimeError, match="no free cluster index row"):
        arena.write("b", 0, index)
    with pytest.raises(ValueError, match="exceed the cluster arena's plan"):
        arena.plan_rows([(0, 0, 1, 1, 1)] * 5)
    with pytest.raises(ValueError):
        _arena(clusters=0)


@pytest.mark.parametrize(
    "dtype, sums", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)]
)
def test_value_sums_in_the_model_dtype_and_bytes_counted(dtype, sums):
    """Value sums in the model's dtype (bf16 for float16, whose range a sum may pass); ``num_bytes`` is what the
    arena's buffers hold (the plan is excluded)."""
    arena = ClusterArena(3, 2, 64, 16, HEADS, DIM, dtype, "cpu", plan_rows=4)
    assert all(layer[4].dtype == sums and layer[0].dtype == dtype for layer in arena.layers)
    held = sum(t.numel() * t.element_size() for layer in arena.layers for t in layer)
    assert ClusterArena.num_bytes(3, 2, 64, 16, HEADS, DIM, dtype) == held
    keys, values = torch.randn(2, 24, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    index = build_cluster_index(keys.to(dtype), values, start=0, avg_cluster_size=4)
    arena.write("a", 0, index)
    assert torch.equal(arena.read("a", 0, 0, 24, index.num_clusters).value_sums, index.value_sums.to(sums))
