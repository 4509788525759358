"""RetroInfer through the engine on CPU: every cluster retrieved equals dense greedy tokens, a small
ratio reads sink + recent + its clusters only, the index grows in update blocks during decode, and
the config's checks and the missing estimation term are clear errors."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from tiny_models import DEFAULT_MODEL

import sparse_methods as sm
from sparse_serve import LLM, SamplingParams

PROMPTS = ["def parse(text):" * 40, "Return the number of" * 30, "x = 1\n" * 50]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SMALL = dict(
    sparse_method="retroinfer",
    retroinfer_sink_tokens=4,
    retroinfer_recent_tokens=8,
    retroinfer_min_index_tokens=64,
    retroinfer_update_tokens=8,
    retroinfer_avg_cluster_size=4,
    retroinfer_estimation_ratio=0.0,
)


def _llm(**kw) -> LLM:
    return LLM(str(DEFAULT_MODEL), **{"device": "cpu", "max_model_len": 1024, "max_num_batched_tokens": 128, **kw})


def _tokens(llm: LLM):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _record_indexes(llm: LLM) -> list:
    """Every index the method answers with, in order (the method drops them when requests finish)."""
    method, seen = llm.engine.method, []
    update = method._update

    def recording(key, keys, processed):
        index = update(key, keys, processed)
        if index is not None:
            seen.append((key, processed, index))
        return index

    method._update = recording
    return seen


def test_every_cluster_retrieved_equals_dense():
    llm = _llm(**SMALL, retroinfer_retrieval_ratio=1.0)
    seen = _record_indexes(llm)
    assert _tokens(llm) == _tokens(_llm())
    assert seen and llm.engine.runner.attention.selective.num_selections > 0


def test_small_ratio_reads_sink_recent_and_its_clusters_and_index_grows():
    llm = _llm(**SMALL, retroinfer_retrieval_ratio=0.1)
    method, c = llm.engine.method, llm.engine.method.config
    seen = _record_indexes(llm)
    answers = []
    select = method.decode_selection

    def recording(layer, request, view):
        chosen = select(layer, request, view)
        if chosen is not None:
            answers.append((view.kv_len, method.index(request.request_id, layer), chosen))
        return chosen

    method.decode_selection = recording
    assert all(len(t) == GREEDY.max_tokens for t in _tokens(llm))
    assert answers
    for kv_len, index, chosen in answers:
        retrieved = max(1, round(index.num_clusters * 0.1))
        for h, row in enumerate(chosen.indices.tolist()):
            row = [t for t in row if t >= 0]
            middle = [t for t in row if index.start <= t < index.end]
            assert row == sorted(row) and row[-1] == kv_len - 1
            assert [t for t in row if t < index.start] == list(range(c.retroinfer_sink_tokens))
            assert [t for t in row if t >= index.end] == list(range(index.end, kv_len))
            clusters = {
                int(torch.searchsorted(index.offsets[h], index.sorted_positions[h].tolist().index(t), right=True)) - 1
                for t in middle
            }
            assert len(clusters) <= retrieved
            assert len(middle) == int(index.sizes[h, sorted(clusters)].sum()) < index.end - index.start
    for _, processed, index in seen:
        assert index.start == c.retroinfer_sink_tokens
        held_back = processed - c.retroinfer_recent_tokens - index.end
        assert 0 <= held_back < c.retroinfer_update_tokens  # appended in whole update blocks
        assert sorted(index.sorted_positions[0].tolist()) == list(range(index.start, index.end))
    first = {}
    for key, _, index in seen:
        first.setdefault(key, index.end)
    assert any(index.end > first[key] for key, _, index in seen)  # blocks appended during decode


def test_config_checks_and_missing_estimation_are_clear_errors():
    shape = sm.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
    method = sm.build_method("retroinfer", shape)
    assert (method.config.retroinfer_sink_tokens, method.config.retroinfer_recent_tokens) == (4, 64)
    assert (method.config.retroinfer_min_index_tokens, method.config.retroinfer_update_tokens) == (16384, 1024)
    assert method.config.retroinfer_avg_cluster_size == 16
    assert (method.config.retroinfer_retrieval_ratio, method.config.retroinfer_estimation_ratio) == (0.018, 0.232)
    assert method.decode_read_tokens(0, 16000, 16) == 16000  # no index yet: reads everything
    clusters = (131072 - 1 - 68) // 16
    assert method.decode_read_tokens(0, 131072, 16) == 69 + round(clusters * 0.018) * 16 + clusters
    for bad in (
        dict(retroinfer_retrieval_ratio=0.0),
        dict(retroinfer_retrieval_ratio=0.8, retroinfer_estimation_ratio=0.3),
        dict(retroinfer_update_tokens=1000),
        dict(retroinfer_min_index_tokens=100),
    ):
        with pytest.raises((ValidationError, ValueError)):
            sm.build_method("retroinfer", shape, **bad)
    llm = _llm(**{**SMALL, "retroinfer_estimation_ratio": 0.2})
    with pytest.raises(NotImplementedError, match="retroinfer_estimation_ratio=0"):
        _tokens(llm)
