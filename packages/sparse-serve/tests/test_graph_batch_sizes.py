"""The batch sizes the engine captures decode graphs for: every size up to EXACT_GRAPH_SIZES (a batch that small runs
its own graph, so the decode kernels' split count is its own), then multiples of 8 and the largest; every batch up to
the largest has a bucket, at most 7 rows larger past the exact sizes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sparse_serve.cuda_graphs import EXACT_GRAPH_SIZES, graph_batch_sizes


@given(st.integers(1, 600))
def test_every_batch_has_a_close_bucket(max_batch_size):
    sizes = graph_batch_sizes(max_batch_size)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch_size
    for batch in range(1, max_batch_size + 1):
        bucket = next(s for s in sizes if s >= batch)
        if batch <= EXACT_GRAPH_SIZES:
            assert bucket == batch
        else:
            assert bucket - batch < 8
    assert all(s % 8 == 0 for s in sizes[:-1] if s > EXACT_GRAPH_SIZES)


def test_sizes_at_a_glance():
    assert graph_batch_sizes(5) == [1, 2, 3, 4, 5]
    assert graph_batch_sizes(64)[-5:] == [32, 40, 48, 56, 64]
    assert graph_batch_sizes(150)[-3:] == [136, 144, 150]
