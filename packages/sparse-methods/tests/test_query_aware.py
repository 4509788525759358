"""Quest's page selection and OmniKV's token filter against references written from the papers
(loops, random inputs)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_kernels
import sparse_methods as sm
from sparse_methods.base import DecodeBatch


def _one_row(query, pages_or_len, block_size, **kw) -> DecodeBatch:
    """A one-request ``DecodeBatch`` whose table is blocks ``0 .. pages - 1`` in order."""
    pages = -(-pages_or_len // block_size) if "key_cache" in kw else pages_or_len
    kv_len = pages_or_len if "key_cache" in kw else pages * block_size
    return DecodeBatch(
        query=query[None],
        kv_lens=torch.tensor([kv_len]),
        table_indices=torch.arange(pages, dtype=torch.int32),
        table_start=torch.tensor([0]),
        max_pages=pages,
        block_size=block_size,
        **kw,
    )


def select_pages(query, kmin, kmax, *, sink, keep, recent):
    """Quest's selection (``select_decode``, the reference kernels) of one request whose pages are
    the blocks of ``kmin`` / ``kmax``, with its budgets in pages."""
    num_pages, hkv, d = kmin.shape
    method = sm.build_method(
        "quest",
        sm.ModelShape(4, query.shape[0], hkv, d),
        sink_keep_tokens=sink * 4,
        decode_keep_tokens=keep * 4,
        recent_keep_tokens=recent * 4,
        quest_chunk_size=4,
    )
    return method.select_decode(2, _one_row(query, num_pages, 4, page_min=kmin, page_max=kmax))[0]


def _reference(query, kmin, kmax, sink, keep, recent):
    """Per KV head: bound each page by sum_d max(q_d*max_d, q_d*min_d), the max over the group's query
    heads, rounded to bfloat16; take the first ``sink`` and last ``recent`` pages and the ``keep`` best others
    (ties: earlier)."""
    num_pages, hkv, _ = kmin.shape
    g = query.shape[0] // hkv
    out = []
    for h in range(hkv):
        bounds = []
        for p in range(num_pages):
            per_head = [
                sum(
                    max(float(query[qh, d] * kmax[p, h, d]), float(query[qh, d] * kmin[p, h, d]))
                    for d in range(kmin.shape[2])
                )
                for qh in range(h * g, (h + 1) * g)
            ]
            bounds.append(float(torch.tensor(max(per_head)).bfloat16()))  # Quest ranks bfloat16 bounds
        s = min(sink, num_pages)
        r = min(recent, num_pages - s)
        middle = list(range(s, num_pages - r))
        best = sorted(middle, key=lambda p: (-bounds[p], p))[:keep]
        out.append(sorted(set(range(s)) | set(best) | set(range(num_pages - r, num_pages))))
    return out


@settings(max_examples=40, deadline=None)
@given(
    num_pages=st.integers(1, 24),
    hkv=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 4]),
    sink=st.integers(0, 3),
    keep=st.integers(0, 8),
    recent=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_select_pages_matches_the_paper(num_pages, hkv, g, sink, keep, recent, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_pages, 4, hkv, 8, generator=gen)
    kmin, kmax = keys.amin(1), keys.amax(1)
    query = torch.randn(hkv * g, 8, generator=gen)
    ours = select_pages(query, kmin, kmax, sink=sink, keep=keep, recent=recent).tolist()
    assert ours == _reference(query, kmin, kmax, sink, keep, recent)


def test_upper_bound_bounds_every_key():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 16, 2, 8, generator=gen)  # pages, tokens, heads, dim
    query = torch.randn(8, 8, generator=gen)  # 4 query heads per KV head
    bound = torch.empty(1, 2, 6)
    batch = _one_row(query, 6, 16)
    sparse_kernels.page_bounds(
        batch.query, keys.amin(1), keys.amax(1), batch.table_indices, batch.table_start, torch.tensor([6]), bound
    )
    bound = bound[0]
    for h in range(2):
        exact = torch.einsum("gd,ptd->gpt", query[h * 4 : (h + 1) * 4], keys[:, :, h]).amax(dim=(0, 2))
        assert torch.all(bound[h] >= exact - 1e-5)


def test_quest_declarations_and_dense_under_budget():
    method = sm.build_method("quest", sm.ModelShape(4, 8, 2, 16))
    assert method.prefix_cache_mode is sm.PrefixCacheMode.RADIX
    # its pages are the engine's blocks of quest_chunk_size tokens (the engine refuses other block sizes)
    assert method.storage == sm.Storage(sm.StoreKind.PAGED_WITH_SUMMARIES, summary_dtype="int8", page_tokens=16)
    exact = sm.build_method("quest", sm.ModelShape(4, 8, 2, 16), quest_summary_dtype="model", quest_chunk_size=32)
    assert exact.storage == sm.Storage(sm.StoreKind.PAGED_WITH_SUMMARIES, page_tokens=32)
    assert method.budget == 64 + 1472 + 512
    modes = [method.layer_plan(layer).decode for layer in range(4)]
    assert modes == [sm.DecodeRead.ALL] * 2 + [sm.DecodeRead.SELECTED] * 2
    assert method.selection_size(2000, 16) is None  # within budget: dense


def test_quest_pages_are_the_blocks():
    """Quest's pages are the engine's blocks: selecting over blocks of another size than quest_chunk_size fails."""
    method = sm.build_method("quest", sm.ModelShape(4, 8, 2, 16), quest_chunk_size=16)
    assert method.selection_size(4096, 16) == (64 + 1472 + 512) // 16
    with pytest.raises(ValueError, match="block_size"):
        method.selection_size(4096, 8)


def _omnikv_reference(query, keys, sink, keep, recent):
    """OmniKV's filter: per query head softmax(q.k / sqrt(d)) over all tokens, max over heads; sink + best
    ``keep`` of the middle + ``recent`` (ties: earlier)."""
    length, hkv, d = keys.shape
    g = query.shape[0] // hkv
    probs = []
    for qh in range(query.shape[0]):
        logits = torch.tensor([float(query[qh] @ keys[t, qh // g]) / math.sqrt(d) for t in range(length)])
        probs.append(torch.softmax(logits, 0))
    score = torch.stack(probs).amax(0).tolist()
    s = min(sink, length)
    r = min(recent, length - s)
    middle = sorted(range(s, length - r), key=lambda t: (-score[t], t))[:keep]
    return sorted(set(range(s)) | set(middle) | set(range(length - r, length)))


@settings(max_examples=30, deadline=None)
@given(length=st.integers(21, 120), g=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_omnikv_filter_matches_the_paper(length, g, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, 2, 8, generator=gen)
    query = torch.randn(2 * g, 8, generator=gen)
    method = sm.build_method(
        "omnikv",
        sm.ModelShape(6, 2 * g, 2, 8),
        sink_keep_tokens=4,
        decode_keep_tokens=10,
        recent_keep_tokens=6,
        full_attention_layers="1,3",
    )
    assert method.filter_layers == [1, 3]
    pages = math.ceil(length / 16)
    key_cache = torch.zeros(pages * 16, 2, 8)
    key_cache[:length] = keys
    batch = _one_row(query, length, 16, key_cache=key_cache.view(pages, 16, 2, 8), sm_scale=8**-0.5)
    plans = [method.layer_plan(layer) for layer in range(3)]
    assert not plans[0].selects_decode and plans[1].decode_keys and not plans[2].decode_keys
    assert plans[1].decode is sm.DecodeRead.OBSERVED  # the filter layer reads everything
    assert method.select_decode(1, batch) is None
    chosen = method.select_decode(2, batch)[0]
    assert plans[2].unit is sm.Unit.SLOT and chosen.shape[0] == 2
    assert chosen[0].tolist() == chosen[1].tolist() == _omnikv_reference(query, keys, 4, 10, 6)


def test_omnikv_auto_layers_follow_the_paper_for_32_layers():
    assert sm.build_method("omnikv", sm.ModelShape(32, 32, 8, 128)).filter_layers == [2, 8, 18]
    with pytest.raises(ValueError):
        sm.make_config("omnikv", full_attention_layers="two")


def test_omnikv_prefill_scores_are_the_mean_raw_qk_max_over_heads():
    from sparse_methods.methods.omnikv import prefill_history_scores

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 4, 8, generator=gen), torch.randn(30, 2, 8, generator=gen)
    expected = [max(sum(float(q[i, h] @ k[t, h // 2]) for i in range(5)) / 5 for h in range(4)) for t in range(30)]
    torch.testing.assert_close(prefill_history_scores(q, k), torch.tensor(expected))
