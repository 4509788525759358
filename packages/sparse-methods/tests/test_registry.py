"""The registry: declarations of every method, one parameter vocabulary, clear errors."""

from __future__ import annotations

import pytest

import sparse_methods as sm

SHAPE = sm.ModelShape(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=16)


def test_every_method_declares_the_contract():
    assert set(sm.method_names()) >= {"dense", "streamingllm", "snapkv", "pyramidkv", "h2o"}
    for name in sm.method_names():
        cls = sm.get_method_class(name)
        assert isinstance(cls.category, sm.Category)
        assert isinstance(cls.prefill_policy, sm.PrefillPolicy)
        assert isinstance(cls.prefix_cache_mode, sm.PrefixCacheMode)
        plan = sm.build_method(name, SHAPE).memory_plan(1000, 100, 256)
        assert len(plan.peak_tokens) == SHAPE.num_layers
        assert all(r <= p for r, p in zip(plan.resident_tokens, plan.peak_tokens, strict=True))
        assert all(p <= 1100 for p in plan.peak_tokens)


def test_declarations_follow_the_method_reference():
    get = sm.get_method_class
    assert get("dense").prefix_cache_mode is sm.PrefixCacheMode.RADIX
    for name in ("streamingllm", "snapkv", "pyramidkv", "h2o"):
        assert get(name).prefix_cache_mode is sm.PrefixCacheMode.CHAIN
        assert get(name).category is sm.Category.PHYSICAL_EVICTION
    assert get("pyramidkv").prefill_policy is sm.PrefillPolicy.LONG_BS1FULL_SHORT_BATCH
    assert get("snapkv").prefill_policy is sm.PrefillPolicy.ALL_CHUNKED


def test_se_defaults():
    snap = sm.make_config("snapkv")
    assert (snap.sink_keep_tokens, snap.decode_keep_tokens, snap.recent_keep_tokens) == (64, 7616, 512)
    assert snap.observation_window_size == 32
    h2o = sm.make_config("h2o")
    assert (h2o.h2o_prefill_budget, h2o.h2o_decode_budget, h2o.h2o_recent_ratio) == (8192, 4096, 0.5)
    assert sm.make_config("pyramidkv").decode_eviction_interval == 1024
    assert sm.make_config("streamingllm").sink_keep_tokens == 64


def test_memory_plans_of_a_long_prompt():
    snap = sm.build_method("snapkv", SHAPE).memory_plan(131072, 2048, 8192)
    assert snap.prefill_peak_tokens == (131072,) * 4 and snap.resident_tokens == (8192,) * 4
    assert snap.decode_peak_tokens == (8192 + 2048,) * 4
    h2o = sm.build_method("h2o", SHAPE, "h2o_prefill").memory_plan(131072, 2048, 2048)
    assert h2o.prefill_peak_tokens == (8192 + 2048,) * 4
    pyr = sm.build_method("pyramidkv", SHAPE).memory_plan(131072, 2048, 8192)
    assert pyr.resident_tokens[0] > pyr.resident_tokens[-1]


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("snapkvv", {}, "unknown sparse_method"),
        ("snapkv", {"h2o_decode_budget": 3}, "has no parameter"),
        ("snapkv", {"sink_keep_tokens": -1}, "greater than or equal"),
        ("snapkv", {"recent_keep_tokens": 8, "observation_window_size": 32}, "must cover"),
        ("dense", {"sink_keep_tokens": 4}, "has no parameter"),
    ],
)
def test_bad_parameters_are_errors(name, params, match):
    with pytest.raises(ValueError, match=match):
        sm.make_config(name, **params)


def test_prefill_method_must_fit_the_method():
    assert sm.make_config("h2o", "h2o_prefill").prefill_sparse_method == "h2o_prefill"
    with pytest.raises(ValueError, match="works with"):
        sm.make_config("snapkv", "h2o_prefill")
    with pytest.raises(ValueError, match="unknown prefill_sparse_method"):
        sm.make_config("h2o", "nope")
