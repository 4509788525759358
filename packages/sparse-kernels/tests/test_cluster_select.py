"""RetroInfer's selection by count: the reference equals a plain per-row ranking of the scores truncated to 16
mantissa bits (float32 bits >> 7; the best ``k1`` columns best first, ties to the lower column, then the next
``k2 - k1`` in column order, then the rest in column order); the Triton path (a radix select over chunks of
columns, one chunk or several, and a sort of the retrieved only) equals the reference but for columns whose
truncated scores may differ by float32 rounding (a score that close to a truncation step), and leaves its shared
state at 0."""

from __future__ import annotations

import struct

import pytest
import torch
from cluster_ranking_cases import case, plain_scores
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_kernels._triton import cluster_select as select_mod
from sparse_kernels.cluster_logits import cluster_logits, softmax_statistics
from sparse_kernels.cluster_select import cluster_select, selection_counts


def _truncated(x: float) -> int:
    """A score's rank: its float32 bits without the 7 lowest, plus one; 0 for an empty column (-inf)."""
    return 0 if x == float("-inf") else (struct.unpack("<i", struct.pack("<f", x))[0] >> 7) + 1


def _truncated_all(scores):
    return torch.tensor([_truncated(float(x)) for x in scores.flatten()], dtype=torch.int64).view(scores.shape)


def _plain_select(scores, retrieved, estimated, read_width, estimate_width):
    """The selection by ``scores`` (any numbers: floats, or truncated ones), ties to the lower column."""
    n, heads, columns = scores.shape
    out = torch.zeros(n, heads, columns, dtype=torch.int64)
    for r in range(n):
        k1 = min(max(int(retrieved[r]), 0), read_width, columns)
        k2 = min(k1 + min(max(int(estimated[r]), 0), estimate_width), columns)
        for h in range(heads):
            ranked = sorted(range(columns), key=lambda c: (-float(scores[r, h, c]), c))
            out[r, h] = torch.tensor(ranked[:k1] + sorted(ranked[k1:k2]) + sorted(ranked[k2:]), dtype=torch.int64)
    return out


def _near(scores, a, b, rel=1e-6) -> bool:
    """Whether float32 scores within ``rel`` (their rounding) of the plain ``scores`` of columns ``a`` and ``b``
    may truncate to the same value or pass each other once truncated: their ranges of truncations overlap."""
    x, y = float(scores[a]), float(scores[b])
    if x == float("-inf") or y == float("-inf"):
        return x == y
    lo_x, hi_x = _truncated(x * (1 - rel)), _truncated(x * (1 + rel))
    lo_y, hi_y = _truncated(y * (1 - rel)), _truncated(y * (1 + rel))
    return lo_x <= hi_y and lo_y <= hi_x


def _assert_same_but_near_ties(got, want, scores, counts):
    """Equal, except that columns whose truncated scores may differ by float32 rounding may swap: within the
    retrieved places (every pair of columns in the other order than ``want``'s), and across the boundaries
    between the parts (compared as sets)."""
    assert got.shape == want.shape and got.dtype == torch.int64
    assert torch.equal(got.sort(-1).values, torch.arange(got.shape[-1]).expand_as(got))  # a permutation
    for r, h in {(r, h) for r, h, _ in (got != want).nonzero().tolist()}:
        k1, k2 = int(counts[0][r]), int(counts[1][r])
        row = scores[r, h]
        place = {c: k for k, c in enumerate(want[r, h, :k1].tolist())}
        kept = [c for c in got[r, h, :k1].tolist() if c in place]
        for i, a in enumerate(kept):  # a column passed another: their truncated scores may tie or swap
            for b in kept[i + 1 :]:
                assert place[a] < place[b] or _near(row, a, b), (r, h, a, b)
        moved = set()
        for lo, hi in ((0, k1), (k1, k2), (k2, got.shape[-1])):
            moved |= set(got[r, h, lo:hi].tolist()) ^ set(want[r, h, lo:hi].tolist())
        for c in moved:  # a column in one part here and another there: its score ties a kept one's
            assert any(_near(row, c, d) for d in want[r, h].tolist() if d != c), (r, h, c)


@pytest.mark.parametrize("ties", [False, True])
def test_reference_equals_the_plain_selection(ties):
    logits, sizes = case(0, ties=ties)
    scores = plain_scores(logits, sizes)
    retrieved, estimated = torch.tensor([5, 9]), torch.tensor([20, 70])
    got = cluster_select(logits, sizes, retrieved, estimated, read_width=9, estimate_width=40, backend="reference")
    want = _plain_select(_truncated_all(scores), retrieved, estimated, 9, 40)
    _assert_same_but_near_ties(got, want, scores, selection_counts(retrieved, estimated, 70, 9, 40))
    if ties:
        assert torch.equal(got, want)


@pytest.mark.parametrize("low_bits", [False, True])
def test_reference_ranks_by_the_truncated_float32_scores(low_bits):
    """The reference's float32 scores (torch's softmax, summed over the group) truncated here, ranked plainly:
    the same selection exactly. With ``low_bits`` many columns' scores differ only in their 7 lowest mantissa
    bits: tied once truncated, they go in column order, not in the order of their float scores."""
    logits, sizes = case(1, columns=90, low_bits=low_bits)
    probs = torch.softmax(logits, dim=-1).sum(2).masked_fill(sizes == 0, float("-inf"))
    retrieved, estimated = torch.tensor([30, 12]), torch.tensor([40, 50])
    got = cluster_select(logits, sizes, retrieved, estimated, read_width=30, estimate_width=50, backend="reference")
    truncated = _truncated_all(probs)
    assert torch.equal(got, _plain_select(truncated, retrieved, estimated, 30, 50))
    if low_bits:
        live = sizes > 0
        same = (truncated[..., :, None] == truncated[..., None, :]) & (probs[..., :, None] != probs[..., None, :])
        assert int((same & live[..., :, None]).sum()) // 2 > 100  # pairs of distinct scores tied once truncated
        assert not torch.equal(got, _plain_select(probs, retrieved, estimated, 30, 50))  # the float order differs


@settings(max_examples=14, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    columns=st.integers(1, 90),
    ratios=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    chunk=st.sampled_from([16, 32, 128]),
    ties=st.booleans(),
    low_bits=st.booleans(),
)
def test_triton_equals_reference(seed, columns, ratios, chunk, ties, low_bits):
    logits, sizes = case(seed, columns=columns, ties=ties, low_bits=low_bits)
    read_width = max(1, round(columns * ratios[0]))
    estimate_width = round(columns * ratios[1])
    retrieved = torch.tensor([read_width, max(0, read_width - 2)])
    estimated = torch.tensor([estimate_width, estimate_width + 5])
    want = cluster_select(
        logits, sizes, retrieved, estimated, read_width=read_width, estimate_width=estimate_width, backend="reference"
    )
    old, select_mod.CHUNK = select_mod.CHUNK, chunk
    try:
        got = select_mod.cluster_select_triton(
            logits, sizes, *softmax_statistics(logits), retrieved, estimated, read_width, estimate_width
        )
    finally:
        select_mod.CHUNK = old
    counts = selection_counts(retrieved, estimated, columns, read_width, estimate_width)
    _assert_same_but_near_ties(got, want, plain_scores(logits, sizes), counts)
    # The state is shared by every call (one buffer, no memset): each call leaves it at 0 for the next, whose
    # shape differs (the examples run one after another in this process).
    assert int(select_mod._STATE[logits.device][0].count_nonzero()) == 0


def test_triton_with_the_logits_kernels_tile_statistics(triton_device):
    gen = torch.Generator().manual_seed(3)
    n, heads, group, dim, total, columns = 2, 2, 4, 32, 400, 300
    query = torch.randn(n, heads * group, dim, generator=gen)
    centroids = torch.randn(heads, total, dim, generator=gen)
    sizes = torch.randint(0, 5, (heads, total), generator=gen, dtype=torch.int32)
    bases, counts = torch.tensor([0, 120]), torch.tensor([300, 250])
    args = [t.to(triton_device) for t in (query, centroids, sizes, bases, counts)]
    ranked = cluster_logits(*args, columns, scale=0.2, backend="triton")
    retrieved, estimated = torch.tensor([6, 5]), torch.tensor([70, 58])
    got = cluster_select(
        ranked.logits, ranked.sizes, retrieved.to(triton_device), estimated.to(triton_device), read_width=6,
        estimate_width=70, tile_max=ranked.tile_max, tile_sum=ranked.tile_sum,
    )  # fmt: skip
    logits, size = ranked.logits.cpu(), ranked.sizes.cpu()
    want = cluster_select(logits, size, retrieved, estimated, read_width=6, estimate_width=70, backend="reference")
    _assert_same_but_near_ties(
        got.cpu(), want, plain_scores(logits, size), selection_counts(retrieved, estimated, 300, 6, 70)
    )


def test_bad_arguments_are_refused():
    logits, sizes = case(0)
    counts = torch.tensor([1, 1])
    with pytest.raises(ValueError, match="sizes"):
        cluster_select(logits, sizes[:, :1], counts, counts, read_width=1, estimate_width=1)
    with pytest.raises(ValueError, match="read_width"):
        cluster_select(logits, sizes, counts, counts, read_width=0, estimate_width=1)
    with pytest.raises(ValueError, match="count per row"):
        cluster_select(logits, sizes, counts[:1], counts, read_width=1, estimate_width=1)
