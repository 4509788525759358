"""RetroInfer indexes the blocks a step completes for several requests in one k-means per layer (their KV heads
stacked): each request's index, read back from the arena, equals indexing its blocks one by one in plain torch
(``build_cluster_index`` per block, appended with ``concat_indexes``), for requests that start an index, append
one block or several in the step, or are not due; with and without value sums, with a batch small enough
that the stacked blocks split into several products, and with appended blocks of both layers indexed in one
k-means (the layers' heads stacked until the last layer) or flushed early by the graphed builder's size cap."""

from __future__ import annotations

import pytest
import torch

import sparse_methods as sm
from sparse_kernels.cluster_index import build_cluster_index, concat_indexes
from sparse_kernels.cluster_index_graphs import GraphedIndexBuilder
from sparse_methods import ClusterArena
from sparse_methods.attention_batch import LayerAttentionBatch
from sparse_methods.base import LayerAttention, RequestStep
from sparse_methods.methods import retroinfer

SHAPE = sm.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8)
CONFIG = dict(
    retroinfer_sink_tokens=2,
    retroinfer_recent_tokens=4,
    retroinfer_min_index_tokens=24,
    retroinfer_update_tokens=8,
    retroinfer_avg_cluster_size=4,
)


def _plain(keys, values, blocks):
    index = None
    for lo, hi, segments in blocks:
        v = None if values is None else values[lo:hi]
        block = build_cluster_index(keys[lo:hi], v, start=lo, avg_cluster_size=4, segments=segments)
        index = block if index is None else concat_indexes(index, block)
    return index


@pytest.mark.parametrize("estimation", [0.2, 0.0])
@pytest.mark.parametrize("stacked", [retroinfer.STACKED_TOKENS, 16])
@pytest.mark.parametrize("cap", [None, 24])
def test_blocks_indexed_together_equal_one_by_one(estimation, stacked, cap, monkeypatch):
    monkeypatch.setattr(retroinfer, "STACKED_TOKENS", stacked)
    method = sm.build_method("retroinfer", SHAPE, retroinfer_estimation_ratio=estimation, **CONFIG)
    if cap is not None:  # 8-token blocks x 2 heads: at most one block's heads per k-means
        method._blocks = GraphedIndexBuilder(max_token_heads=cap)
    builds = []
    build = method._flush

    def flushing():
        builds.append(len(method._pending))
        return build()

    method._flush = flushing
    method.cluster_arena = ClusterArena(2, 4, 128, 32, 2, 8, torch.float32, "cpu", plan_rows=4)
    gen = torch.Generator().manual_seed(0)
    keys = {r: torch.randn(90, 2, 8, generator=gen) for r in "abcd"}
    values = {r: torch.randn(90, 2, 8, generator=gen) for r in "abcd"}
    observed = method.observes_values
    plans = {}  # request -> blocks so far

    def step(processed: dict[str, int]) -> None:
        method._observing = dict(processed)
        requests = tuple(RequestStep(r, n - 1, 1, n - 1, (n - 1,) * 2) for r, n in processed.items())
        views = [
            LayerAttention(torch.zeros(1, 4, 8), keys[r][:n], 1.0, None, values[r][:n] if observed else None)
            for r, n in processed.items()
        ]
        for layer in range(2):
            method.on_attention_end(layer, LayerAttentionBatch.of_views(requests, views))

    # a starts at 40 (index over [2, 36)); b at 30 ([2, 26)); c too short; then a appends 2 blocks, b 1, d starts
    step({"a": 40, "b": 30, "c": 20})
    plans["a"], plans["b"] = [(2, 36, None)], [(2, 26, None)]
    step({"a": 56, "b": 38, "c": 27, "d": 70})
    plans["a"] += [(36, 44, 1), (44, 52, 1)]
    plans["b"] += [(26, 34, 1)]
    plans["d"] = [(2, 66, None)]
    assert method.index("c", 0) is None
    for r, blocks in plans.items():
        want = _plain(keys[r], values[r] if observed else None, blocks)
        for layer in range(2):
            got = method.index(r, layer)
            assert (got.start, got.end, got.num_clusters) == (want.start, want.end, want.num_clusters)
            torch.testing.assert_close(got.centroids, want.centroids)
            if observed:
                torch.testing.assert_close(got.value_sums, want.value_sums)
            else:
                assert got.value_sums is None
            for name in ("sizes", "offsets", "sorted_positions"):
                assert torch.equal(getattr(got, name), getattr(want, name).to(getattr(got, name).dtype)), name
    stacks = [n for n in builds if n]
    assert stacks and (max(stacks) > 1 if cap is None else max(stacks) == 1)  # both layers in one k-means, or not
    method.release("a")
    assert method.index("a", 0) is None and "a" not in method.cluster_arena.rows
