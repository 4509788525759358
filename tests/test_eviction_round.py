"""A decode-time eviction round: each layer's compacting requests in one call, scored as one batch.

``on_attention_end`` gets every observed request of a layer at once (``LayerAttentionBatch``); for decode
rows over a plain paged store the batch comes as tensors (the keys left in their pages), and an evicting
window scorer with a query ring takes every compacting request's window from the ring in one gather,
scores with ``score_batch`` and ranks with ``keep_indices_batch``, per layer. Each request through its
own view (``observes_batched`` False) is the reference: the same kept slots, tokens and chain states,
for requests of different lengths, pipelined or not.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_async_scheduling import drive, greedy
from test_eviction_pipeline import _llm, _spy

from sparse_methods import eviction_round

_rng = random.Random(9)
PROMPTS = [[_rng.randrange(3, 4000) for _ in range(n)] for n in (30, 45, 60, 70)]
# Windows no longer than the interval: at a decode eviction every window is all in the ring.
ROUND = {
    "snapkv": dict(observation_window_size=4, decode_eviction_interval=6),
    "pyramidkv": dict(observation_window_size=4, decode_eviction_interval=5),
    "rkv": {},
    "skipkv": {},
    "tova": {},
}


def _run(method: str, batched: bool, after: list | None = None, **config):
    """Tokens, kept slots, the chain's saved windows and each batched round's size; ``after`` collects the
    requests the engine handed over after a step's forward (``observe_stored``)."""
    llm = _llm(method, max_num_batched_tokens=512, max_num_seqs=8, **ROUND[method], **config)
    llm.engine.method.observes_batched = batched
    outs, releases, rounds = (_spy(llm, name) for name in ("finish_step", "release", "_compact_batch"))
    if after is not None:
        attention = llm.engine.runner.attention
        observe_stored = attention.observe_stored
        attention.observe_stored = lambda meta, observed: (after.append(set(observed)), observe_stored(meta, observed))
    script = {0: [("add", f"r{i}", p, greedy(22, ignore_eos=True)) for i, p in enumerate(PROMPTS)]}
    script[0].append(("add", "t", PROMPTS[2], greedy(14, ignore_eos=True), {"chain_id": "c"}))
    trace = drive(llm, script, chains=("c",))
    keeps = [(rid, c.keep) for _, out in outs for rid, c in sorted(out.items())]
    saved = next(state for (rid, *_), state in releases if rid == "t").window
    return trace, keeps, saved, [len(args[2]) for args, _ in rounds]


@pytest.mark.parametrize("method", sorted(ROUND))
def test_a_round_batched_per_layer_equals_each_request_alone(method):
    trace, keeps, saved, rounds = _run(method, batched=True)
    ref_trace, ref_keeps, ref_saved, ref_rounds = _run(method, batched=False)
    assert trace.tokens == ref_trace.tokens and trace.final == ref_trace.final
    assert ref_rounds == [] and max(rounds) >= 2  # several requests per layer (PyramidKV: per budget)
    assert [rid for rid, _ in keeps] == [rid for rid, _ in ref_keeps]
    for (_, a), (_, b) in zip(keeps, ref_keeps, strict=True):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(saved, ref_saved, strict=True))


@pytest.mark.parametrize("method", ["snapkv", "rkv"])
def test_a_batched_round_pipelines_like_the_synchronous_loop(method):
    sync, *_ = _run(method, batched=True, async_scheduling=False)
    pipelined, _, _, rounds = _run(method, batched=True, async_scheduling=True)
    assert pipelined.tokens == sync.tokens and pipelined.final == sync.final and rounds


def test_a_round_cut_into_chunks_keeps_the_same(monkeypatch):
    """The batch is cut to bound the scores it holds (``MAX_SCORE_ELEMENTS``): here one request a chunk."""
    monkeypatch.setattr(eviction_round, "MAX_SCORE_ELEMENTS", 1)
    trace, keeps, _, rounds = _run("snapkv", batched=True)
    ref_trace, ref_keeps, _, _ = _run("snapkv", batched=False)
    assert trace.tokens == ref_trace.tokens and rounds and set(rounds) == {1}
    for (_, a), (_, b) in zip(keeps, ref_keeps, strict=True):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("method", sorted(ROUND))
def test_a_round_observed_after_the_forward_equals_one_observed_during_it(method, monkeypatch):
    """At a decode round every observed request's window is in the query ring (or its scores in the device's
    sums), so the method reads no query from the forward (``observes_queries`` False for that step): the engine
    runs the forward observing nothing (a GPU replays the step's CUDA graph) and hands the layers over after it,
    from the pool. The same tokens, kept slots and chain windows as observing during the forward."""
    from sparse_methods.eviction import EvictionMethod

    stored = []
    trace, keeps, saved, _ = _run(method, batched=True, after=stored)
    assert stored and all(stored)  # decode rounds observed after their forward
    monkeypatch.setattr(EvictionMethod, "observes_queries", property(lambda self: True))
    never = []
    ref_trace, ref_keeps, ref_saved, _ = _run(method, batched=True, after=never)
    assert not never
    assert trace.tokens == ref_trace.tokens and trace.final == ref_trace.final
    assert [rid for rid, _ in keeps] == [rid for rid, _ in ref_keeps]
    for (_, a), (_, b) in zip(keeps, ref_keeps, strict=True):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(saved, ref_saved, strict=True))
