"""Eviction methods on sliding-window models: they compact the full-attention (global) layers only and
leave each windowed layer every slot (its window is applied by attention over slots that are positions).
Budgets above the context equal dense HF on tiny Gemma 3 (local + global layers) and Mistral (all layers
windowed); on Mistral even small budgets stay dense; a small SnapKV budget on Gemma 3 compacts its
global layer only."""

from __future__ import annotations

import pytest
from test_sliding_window_engine import GEMMA_LAYERS, MAX_NEW, _greedy, _prompts, window_checkpoint  # noqa: F401
from tiny_models import hf_greedy

import sparse_methods as sm
from sparse_methods.eviction import EvictionMethod
from sparse_serve import LLM, SamplingParams

INTERVAL = dict(decode_eviction_interval=4)
BIG = {
    "snapkv": dict(decode_keep_tokens=1000, **INTERVAL),
    "pyramidkv": dict(decode_keep_tokens=1000, **INTERVAL),
    "h2o": dict(h2o_prefill_budget=1000, h2o_decode_budget=1000, **INTERVAL),
    "streamingllm": dict(sink_keep_tokens=4, recent_keep_tokens=1000, **INTERVAL),
    "tova": dict(decode_keep_tokens=1000, **INTERVAL),
    "rkv": dict(decode_keep_tokens=1000),
    "skipkv": dict(decode_keep_tokens=1000),
}
SMALL = {
    "snapkv": dict(sink_keep_tokens=2, decode_keep_tokens=4, observation_window_size=4, recent_keep_tokens=4),
    "pyramidkv": dict(decode_keep_tokens=4, observation_window_size=4, recent_keep_tokens=4),
    "h2o": dict(h2o_prefill_budget=8, h2o_decode_budget=8),
    "streamingllm": dict(sink_keep_tokens=2, recent_keep_tokens=6),
    "tova": dict(decode_keep_tokens=6),
    "rkv": dict(decode_keep_tokens=4, sink_keep_tokens=2, recent_keep_tokens=4),
    "skipkv": dict(decode_keep_tokens=4, sink_keep_tokens=2, recent_keep_tokens=4, skipkv_redundancy_window=4),
}


def _windowed_eviction_methods() -> list[str]:
    return [
        name
        for name in sm.method_names()
        if issubclass(cls := sm.get_method_class(name), EvictionMethod) and sm.Support.SLIDING_WINDOW in cls.supports
    ]


def test_every_windowed_eviction_method_is_tested():
    assert sorted(_windowed_eviction_methods()) == sorted(BIG) == sorted(SMALL)


def _llm(path, name: str, params: dict, **engine) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, sparse_method=name, **params, **engine)


@pytest.mark.parametrize("model", ["gemma3", "mistral"])
@pytest.mark.parametrize("name", list(BIG))
def test_budget_above_context_equals_dense(window_checkpoint, model, name):  # noqa: F811
    path, hf_model = window_checkpoint(model)
    prompts = _prompts(seed=3)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    assert _greedy(_llm(path, name, BIG[name]), prompts) == expected


@pytest.mark.parametrize("name", list(SMALL))
def test_small_budgets_leave_an_all_windowed_model_dense(window_checkpoint, name):  # noqa: F811
    """Mistral slides in every layer: nothing is the method's to compact, whatever its budget."""
    path, hf_model = window_checkpoint("mistral")
    prompts = _prompts(seed=3)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = _llm(path, name, SMALL[name])
    assert llm.engine.method.memory_plan(40, MAX_NEW, 64).resident_tokens == (40,) * len(GEMMA_LAYERS)
    assert _greedy(llm, prompts) == expected


def test_small_snapkv_compacts_only_global_layers(window_checkpoint):  # noqa: F811
    """Gemma 3 (sliding, full, sliding): after a one-chunk prefill of 40 tokens the full layer holds the
    budget (2 + 4 + 4), the sliding ones all 40 slots; decode then grows each layer by one per token."""
    path, _ = window_checkpoint("gemma3")
    llm = _llm(path, "snapkv", SMALL["snapkv"])
    engine = llm.engine
    budget = 2 + 4 + 4
    resident = tuple(40 if t == "sliding_attention" else budget for t in GEMMA_LAYERS)
    assert engine.method.memory_plan(40, MAX_NEW, 64).resident_tokens == resident
    prompt = _prompts(seed=3)[3]
    assert len(prompt) == 40
    rid = engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    engine.step()
    req = engine.scheduler.running[0]
    assert tuple(req.kv_lens) == resident
    for step in range(1, 4):
        engine.step()
        assert tuple(req.kv_lens) == tuple(n + step for n in resident)
    # A table per layer: the global layer holds its budget's blocks, each local one its window's.
    held = [[b for b in engine.kv.table(rid, layer).block_ids if b != engine.kv.null_block] for layer in range(3)]
    assert [len(engine.kv.table(rid, layer).block_ids) for layer in range(3)] == [-(-(n + 3) // 4) for n in resident]
    assert len(held[1]) == -(-(budget + 3) // 4) and all(len(held[layer]) <= 3 for layer in (0, 2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_used_blocks == 0
