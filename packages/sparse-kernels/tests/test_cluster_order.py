"""RetroInfer's cluster ranking order: the reference equals a plain per-row ranking (softmax per query head,
summed over the group, empty clusters last, ties to the lower column); the Triton path (chunks sorted in
registers and placed by rank, or one chunk written directly; the logits kernel's tile statistics or none)
equals the reference but for columns whose scores agree to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from cluster_ranking_cases import case, plain_scores
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_kernels._triton.cluster_order import cluster_order_triton
from sparse_kernels.cluster_logits import cluster_logits, softmax_statistics
from sparse_kernels.cluster_order import cluster_order


def _plain_order(scores, top):
    n, heads, columns = scores.shape
    return torch.tensor(
        [
            [sorted(range(columns), key=lambda c: (-float(scores[r, h, c]), c))[:top] for h in range(heads)]
            for r in range(n)
        ]
    )


def _assert_same_but_near_ties(got, want, scores):
    assert got.shape == want.shape and got.dtype == torch.int64
    for r, h in {(r, h) for r, h, _ in (got != want).nonzero().tolist()}:
        assert len(set(got[r, h].tolist())) == got.shape[-1]  # no column twice
        for k in (got[r, h] != want[r, h]).nonzero().flatten().tolist():
            a, b = float(scores[r, h, got[r, h, k]]), float(scores[r, h, want[r, h, k]])
            assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (r, h, k, a, b)


@pytest.mark.parametrize("ties", [False, True])
def test_reference_equals_the_plain_ranking(ties):
    logits, sizes = case(0, ties=ties)
    scores = plain_scores(logits, sizes)
    got = cluster_order(logits, sizes, 50, backend="reference")
    _assert_same_but_near_ties(got, _plain_order(scores, 50), scores)
    if ties:
        assert torch.equal(got, _plain_order(scores, 50))  # equal logits give equal scores: the lower column first


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    columns=st.integers(1, 90),
    top_frac=st.floats(0.0, 1.0),
    chunk=st.sampled_from([16, 32, 128]),
    ties=st.booleans(),
)
def test_triton_equals_reference(seed, columns, top_frac, chunk, ties):
    logits, sizes = case(seed, columns=columns, ties=ties)
    top = max(1, round(columns * top_frac))
    want = cluster_order(logits, sizes, top, backend="reference")
    got = cluster_order_triton(logits, sizes, *softmax_statistics(logits), top, chunk=chunk)
    _assert_same_but_near_ties(got, want, plain_scores(logits, sizes))


def test_triton_with_the_logits_kernels_tile_statistics(triton_device):
    gen = torch.Generator().manual_seed(3)
    n, heads, group, dim, total, columns = 2, 2, 4, 32, 400, 300
    query = torch.randn(n, heads * group, dim, generator=gen)
    centroids = torch.randn(heads, total, dim, generator=gen)
    sizes = torch.randint(0, 5, (heads, total), generator=gen, dtype=torch.int32)
    bases, counts = torch.tensor([0, 120]), torch.tensor([300, 250])
    args = [t.to(triton_device) for t in (query, centroids, sizes, bases, counts)]
    ranked = cluster_logits(*args, columns, scale=0.2, backend="triton")
    assert ranked.tile_max.shape[-1] > 1
    got = cluster_order(ranked.logits, ranked.sizes, 200, tile_max=ranked.tile_max, tile_sum=ranked.tile_sum)
    logits, size = ranked.logits.cpu(), ranked.sizes.cpu()
    want = cluster_order(logits, size, 200, backend="reference")
    _assert_same_but_near_ties(got.cpu(), want, plain_scores(logits, size))


def test_bad_arguments_are_refused():
    logits, sizes = case(0)
    with pytest.raises(ValueError, match="top"):
        cluster_order(logits, sizes, 0)
    with pytest.raises(ValueError, match="sizes"):
        cluster_order(logits, sizes[:, :1], 5)
