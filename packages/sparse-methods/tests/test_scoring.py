"""Properties of the pure scoring and selection functions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_methods import keep_selection, scoring
from sparse_methods.keep_selection import keep_indices, keep_indices_batch, keep_indices_batch_reference
from sparse_methods.scoring import (
    attention_column_sums,
    attention_column_sums_reference,
    pool_scores,
    pyramid_budgets,
    window_scores,
    window_scores_reference,
)


@settings(max_examples=200, deadline=None)
@given(
    kv_len=st.integers(1, 80),
    sink=st.integers(0, 10),
    recent=st.integers(0, 20),
    num_middle=st.integers(0, 40),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_keep_indices_keeps_sink_recent_and_the_top_scores(kv_len, sink, recent, num_middle, heads, seed):
    scores = torch.rand(heads, kv_len, generator=torch.Generator().manual_seed(seed))
    keep = keep_indices(scores, kv_len=kv_len, sink=sink, recent=recent, num_middle=num_middle)
    s = min(sink, kv_len)
    r = min(recent, kv_len - s)
    expected_n = min(kv_len, s + r + num_middle)
    assert keep.shape == (heads, expected_n)
    for h in range(heads):
        row = keep[h].tolist()
        assert row == sorted(set(row)), "ascending, no duplicates"
        assert set(range(s)) <= set(row) and set(range(kv_len - r, kv_len)) <= set(row)
        middle = [i for i in row if s <= i < kv_len - r]
        dropped = [i for i in range(s, kv_len - r) if i not in row]
        if middle and dropped:  # every kept middle token scores at least as high as every dropped one
            assert min(scores[h, middle]) >= max(scores[h, dropped])


def test_keep_indices_breaks_ties_toward_earlier_tokens():
    scores = torch.ones(1, 10)
    assert keep_indices(scores, kv_len=10, sink=1, recent=2, num_middle=3).tolist() == [[0, 1, 2, 3, 8, 9]]


_SCORE_POOL = [float("-inf"), -2.5, -1e-45, -0.0, 0.0, 1e-45, 0.5, 0.50000006, 3.0, float("inf"), float("nan")]


_KEEP_CASES = dict(
    heads=st.integers(1, 3),
    sink=st.integers(0, 6),
    recent=st.integers(0, 8),
    num_middle=st.integers(0, 40),
    extra=st.lists(st.integers(1, 50), min_size=1, max_size=5),
    padding=st.integers(0, 4),
    distinct=st.integers(1, len(_SCORE_POOL)),
    seed=st.integers(0, 2**16),
)


def _check_keep_batch(heads, sink, recent, num_middle, extra, padding, distinct, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    kv_lens = torch.tensor([sink + num_middle + recent + e for e in extra])
    width = int(kv_lens.max()) - recent + padding
    values = torch.tensor(_SCORE_POOL)[torch.randperm(len(_SCORE_POOL), generator=gen)[:distinct]]
    scores = values[torch.randint(0, distinct, (len(extra), heads, width), generator=gen)]
    kw = dict(sink=sink, recent=recent, num_middle=num_middle)
    got = keep_indices_batch(scores.to(device), kv_lens.to(device), **kw).cpu()
    assert torch.equal(got, keep_indices_batch_reference(scores, kv_lens, **kw))
    for b, kv_len in enumerate(kv_lens.tolist()):
        assert torch.equal(got[b], keep_indices(scores[b], kv_len=kv_len, **kw))
    if device == "cpu" and num_middle:  # the GPU's one-kernel selection, through the kernel's reference here
        middle = keep_selection._middle_scores(scores, (kv_lens - recent).view(-1, 1, 1), sink)
        expect = keep_selection._top_middle(middle, num_middle)
        assert torch.equal(keep_selection._top_middle_device(middle.clone(), num_middle), expect)


@settings(max_examples=150, deadline=None)
@given(**_KEEP_CASES)
def test_keep_indices_batch_selects_as_two_stable_sorts(**case):
    """The topk selection equals the two-sort reference and each request alone, exactly: scores from a
    few distinct values (ties everywhere; -inf, signed zeros, denormals, NaN among them), requests of different
    lengths (1 evicted: almost nothing; up to more evicted than kept), num_middle 0, padded columns."""
    _check_keep_batch(**case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=60, deadline=None)
@given(**_KEEP_CASES)
def test_keep_indices_batch_on_gpu_selects_as_two_stable_sorts(**case):
    """The same on a GPU, where the middle's selection is one ``top_k_ascending`` kernel."""
    _check_keep_batch(**case, device="cuda")


@settings(max_examples=100, deadline=None)
@given(
    mean=st.integers(8, 400),
    window=st.integers(1, 16),
    kv_len=st.integers(16, 800),
    layers=st.integers(1, 40),
    beta=st.floats(1.0, 30.0),
)
def test_pyramid_budgets_average_the_budget_and_shrink_upwards(mean, window, kv_len, layers, beta):
    budgets = pyramid_budgets(mean, window, kv_len, layers, beta)
    assert len(budgets) == layers
    assert budgets == sorted(budgets, reverse=True)
    assert abs(sum(budgets) / layers - mean) <= 1.0  # rounding only
    if budgets[0] != budgets[-1]:
        assert budgets[0] <= kv_len - window + 1 and budgets[-1] >= window - 1


def test_pool_scores_matches_explicit_windows():
    x = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0]])
    assert pool_scores(x, 3, "max").tolist() == [[5.0, 5.0, 5.0, 3.0, 3.0]]
    avg = pool_scores(x, 3, "avg")[0].tolist()  # zero padding counts, as in F.avg_pool1d
    assert avg == pytest.approx([6 / 3, 8 / 3, 7 / 3, 5 / 3, 3 / 3])
    with pytest.raises(ValueError):
        pool_scores(x, 4, "max")


def _naive_probs(q, k, scale, first):
    """[Hq, n, L] causal softmax by explicit loops (GQA by head index arithmetic)."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    n, length = q.shape[0], k.shape[0]
    out = torch.zeros(hq, n, length)
    for h in range(hq):
        for i in range(n):
            logits = torch.tensor([float(q[i, h] @ k[j, h // g]) * scale for j in range(first + i + 1)])
            out[h, i, : first + i + 1] = torch.softmax(logits, 0)
    return out


def test_window_scores_and_column_sums_match_naive_loops():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 6, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    scale = 8**-0.5
    slots = torch.arange(8, 12)
    probs = _naive_probs(q, k, scale, 8)
    sums = attention_column_sums(q, k, scale, query_slots=slots)
    torch.testing.assert_close(sums, probs.sum(1))
    got = window_scores(q, k, scale, query_slots=slots, num_scored=8, kernel_size=1, pooling="none")
    expected = probs.mean(1)[:, :8].view(2, 3, 8).mean(1)
    torch.testing.assert_close(got, expected)
    logits = window_scores(q, k, scale, query_slots=slots, num_scored=8, score_mode="logits", pooling="none")
    raw = torch.einsum("nhd,lhd->hnl", q, k.repeat_interleave(3, dim=1)) * scale
    torch.testing.assert_close(logits, raw[..., :8].view(2, 3, 4, 8).amax(dim=(1, 2)))
    assert math.isclose(float(probs[0, 0].sum()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("chunk_elements", [None, 1, 200])  # all heads at once, one head, a few heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_scores_equal_the_per_head_reference(monkeypatch, chunk_elements, dtype):
    """The batched computation over KV heads (in head chunks when large) equals the per-head loop, for
    every score mode, pooling and group reduction, at awkward sizes and in bf16 (queries non-contiguous,
    as a slice of a fused projection)."""
    if chunk_elements is not None:
        monkeypatch.setattr(scoring, "MAX_SCORE_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(7)
    for hq, hkv, n, length in [(6, 2, 5, 37), (32, 8, 9, 97), (4, 4, 1, 17)]:
        fused = torch.randn(n, hq + 3, 16, generator=g).to(dtype)
        q, k = fused[:, :hq], torch.randn(length, hkv, 16, generator=g).to(dtype)
        slots = torch.arange(length - n, length)
        scored = length - n
        for mode in ("probability", "logits"):
            for pooling, kernel in (("max", 7), ("avg", 5), ("none", 1)):
                for reduce in ("mean", "max", "sum"):
                    kw = dict(query_slots=slots, num_scored=scored, score_mode=mode, kernel_size=kernel)
                    kw.update(pooling=pooling, group_reduce=reduce)
                    got = window_scores(q, k, 0.25, **kw)
                    torch.testing.assert_close(got, window_scores_reference(q, k, 0.25, **kw), rtol=1e-5, atol=1e-6)
        sums = attention_column_sums(q, k, 0.25, query_slots=slots)
        ref = attention_column_sums_reference(q, k, 0.25, query_slots=slots)
        torch.testing.assert_close(sums, ref, rtol=1e-5, atol=1e-6)
