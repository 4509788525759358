"""Decode-time eviction scores and ranks a layer's compacting requests together (issue 15 item 5).

When many requests compact at one step (every running request at a decode-time eviction), an evicting
window scorer keeps each request's scoring inputs until the layer's last one arrives, then scores them
in one batch per budget (``score_batch``: SnapKV's and PyramidKV's window scores batched, others
``score()`` each) and ranks them with one top-k (``keep_indices_batch``). The per-request path is the
reference: the same kept slots, tokens and chain state, for requests of different lengths and budgets.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_async_scheduling import drive, greedy
from test_eviction_pipeline import _llm, _spy

from sparse_methods.keep_selection import keep_indices, keep_indices_batch
from sparse_methods.scoring import window_scores, window_scores_batch

_rng = random.Random(8)
# All prefilled in the first step, so they compact together at the prompt's end and at every decode
# interval; the shortest holds less than the budget (40) at first, so lengths differ at the evictions.
PROMPTS = [[_rng.randrange(3, 4000) for _ in range(n)] for n in (30, 45, 60, 70)]
BATCHED = ("snapkv", "pyramidkv", "rkv", "tova", "skipkv")


@pytest.mark.parametrize("method", BATCHED)
def test_batched_compactions_equal_each_request_alone(method):
    script = {0: [("add", f"r{i}", p, greedy(22, ignore_eos=True)) for i, p in enumerate(PROMPTS)]}
    script[0].append(("add", "t", PROMPTS[2], greedy(12, ignore_eos=True), {"chain_id": "c"}))
    traces, keeps, saved = [], [], []
    for batched in (True, False):
        llm = _llm(method, max_num_batched_tokens=512, max_num_seqs=8)
        llm.engine.method.batches_compactions = batched
        outs, releases = _spy(llm, "finish_step"), _spy(llm, "release")
        traces.append(drive(llm, script, chains=("c",)))
        keeps.append([(rid, c.keep) for _, out in outs for rid, c in sorted(out.items())])
        sizes = [len(out) for _, out in outs]
        saved.append(next(state for (rid, *_), state in releases if rid == "t").window)
    assert traces[0].tokens == traces[1].tokens and traces[0].final == traces[1].final
    assert [rid for rid, _ in keeps[0]] == [rid for rid, _ in keeps[1]]
    assert max(sizes) >= 4  # several requests compacted at one step
    for (_, a), (_, b) in zip(*keeps, strict=True):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(*saved, strict=True))


def _padded(lengths, n, heads, groups, dim, seed):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(L, heads, dim, generator=g) for L in lengths]
    queries = [torch.randn(n, heads * groups, dim, generator=g) for _ in lengths]
    padded = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)
    return queries, keys, padded, torch.tensor(lengths)


@pytest.mark.parametrize("mode", ["probability", "logits"])
@pytest.mark.parametrize("pooling", ["max", "avg", "none"])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_window_scores_batch_equals_each_request(mode, pooling, reduce):
    lengths, n = [23, 40, 31, 9], 6
    queries, keys, padded, kv_lens = _padded(lengths, n, 2, 3, 8, seed=len(mode) + len(pooling))
    kw = dict(score_mode=mode, kernel_size=5, pooling=pooling, group_reduce=reduce)
    batch = window_scores_batch(torch.stack(queries), padded, kv_lens, 0.3, **kw)
    assert batch.shape == (4, 2, max(lengths) - n)
    for b, L in enumerate(lengths):
        slots = torch.arange(L - n, L)
        alone = window_scores(queries[b], keys[b], 0.3, query_slots=slots, num_scored=L - n, **kw)
        torch.testing.assert_close(batch[b, :, : L - n], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_keep_indices_batch_equals_each_request(seed):
    g = torch.Generator().manual_seed(seed)
    lengths, sink, recent, middle = [50, 21, 37, 64], 3, 5, 9
    scores = torch.randint(0, 6, (4, 2, 64), generator=g).float()  # many ties: the earlier slot wins
    batch = keep_indices_batch(scores, torch.tensor(lengths), sink=sink, recent=recent, num_middle=middle)
    for b, L in enumerate(lengths):
        alone = keep_indices(scores[b], kv_len=L, sink=sink, recent=recent, num_middle=middle)
        assert torch.equal(batch[b], alone)
