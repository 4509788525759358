"""The cluster arena: a request's index (value sums included) lands in its own row, an appended block is
written in place beside what is there (equal to writing the grown index whole, and read back as it), rows are
given back and reused, and nothing past the planned capacity is accepted."""

from __future__ import annotations

import pytest
import torch

from sparse_kernels.cluster_index import ClusterIndex, build_cluster_index, concat_indexes
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


def test_stacked_blocks_write_as_each_block_alone():
    """``write_blocks`` of three requests' blocks, their heads stacked in one index with positions from 0, equals
    writing each block alone (its heads of the stacked index, its positions shifted to where it starts), at
    different rows and places; a block that would outgrow its row rejects the whole write before any row is
    taken."""
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 8, 3 * HEADS, DIM, generator=g)
    stacked = build_cluster_index(keys, values, start=0, avg_cluster_size=4, segments=1)
    blocks = [("a", 0, 0, 10), ("b", 2, 8, 30), ("c", 5, 20, 50)]  # (request, at cluster, at token, start)
    together, alone = _arena(rows=5), _arena(rows=5)
    first = build_cluster_index(keys[:, :HEADS], values[:, :HEADS], start=0, avg_cluster_size=4, segments=1)
    for arena in (together, alone):
        arena.write("z", 1, first)  # row 0 held: the blocks go to rows 1-3
    together.write_blocks(1, stacked, blocks)
    for j, (rid, at_cluster, at_token, shift) in enumerate(blocks):
        heads = slice(j * HEADS, (j + 1) * HEADS)
        block = ClusterIndex(
            start=shift, end=shift + 8, centroids=stacked.centroids[heads], value_sums=stacked.value_sums[heads],
            sizes=stacked.sizes[heads], offsets=stacked.offsets[heads],
            sorted_positions=stacked.sorted_positions[heads] + shift,
        )  # fmt: skip
        alone.write(rid, 1, block, at_cluster=at_cluster, at_token=at_token)
    for got, want in zip(together.layers[1], alone.layers[1], strict=True):
        assert torch.equal(got, want)
    assert together.bases("c") == alone.bases("c") == (3 * 64, 3 * 16)
    before = [t.clone() for t in together.layers[0]]
    with pytest.raises(ValueError, match="outgrows its arena row"):
        together.write_blocks(0, stacked, [("d", 0, 0, 0), ("e", 15, 0, 0), ("a", 0, 0, 0)])
    assert "d" not in together.rows
    assert all(torch.equal(a, b) for a, b in zip(before, together.layers[0], strict=True))
    with pytest.raises(ValueError, match="heads, got"):
        together.write_blocks(0, stacked, blocks[:2])


def test_coded_centroids_are_written_with_their_scales_and_read_back_decoded():
    """An arena with ``centroid_codes``: each written centroid is stored as its codes and scale
    (``encode_centroids``), read back decoded, appended blocks land beside the first index, and the bytes held
    are what ``num_bytes`` plans."""
    from sparse_kernels.cluster_logits import decode_centroids, encode_centroids

    keys, values = torch.randn(2, 40, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    first = build_cluster_index(keys[2:26], values[2:26], start=2, avg_cluster_size=4)
    block = build_cluster_index(keys[26:34], values[26:34], start=26, avg_cluster_size=4, segments=1)
    grown = concat_indexes(first, block)
    sizes = (2, 3, 64, 16, HEADS, DIM)
    arena = ClusterArena(*sizes, torch.bfloat16, "cpu", plan_rows=4, centroid_codes=True)
    assert arena.nbytes == ClusterArena.num_bytes(*sizes, torch.bfloat16, centroid_codes=True)
    assert arena.nbytes < ClusterArena.num_bytes(*sizes, torch.bfloat16)
    arena.write("a", 1, first)
    arena.write("a", 1, block, at_cluster=first.num_clusters, at_token=first.sorted_positions.shape[1])
    codes, scale = encode_centroids(grown.centroids)
    stored, stored_scale = arena.centroids(1)
    _, c0 = arena.bases("a")
    c = slice(c0, c0 + grown.num_clusters)
    assert stored.dtype == torch.int8 and torch.equal(stored[:, c], codes) and torch.equal(stored_scale[:, c], scale)
    read = arena.read("a", 1, grown.start, grown.end, grown.num_clusters)
    assert torch.equal(read.centroids, decode_centroids(codes, scale))
    assert torch.equal(arena.centroid_values(1)[:, c], read.centroids)
    for name in ("sizes", "offsets", "sorted_positions"):
        assert torch.equal(getattr(read, name), getattr(grown, name)), name
    assert torch.equal(read.value_sums, grown.value_sums.bfloat16())
