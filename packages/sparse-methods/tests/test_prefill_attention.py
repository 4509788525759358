"""Prefill attention methods (``flashprefill_v2``): one axis that composes with every sparse_method,
parameters in the flat vocabulary, errors that name the field."""

from __future__ import annotations

import pytest

import sparse_methods as sm

SHAPE = sm.ModelShape(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("name", sm.method_names())
def test_flashprefill_composes_with_every_method(name):
    method = sm.build_method(name, SHAPE, "flashprefill_v2", flashprefill_v2_abs_threshold=0.05)
    assert isinstance(method, sm.get_method_class(name))
    assert method.prefill_attention.name == "flashprefill_v2"
    assert method.fingerprint()["prefill"]["flashprefill_v2_abs_threshold"] == 0.05
    assert "prefill" not in sm.build_method(name, SHAPE).fingerprint()
    assert sm.build_method(name, SHAPE).prefill_attention is None


def test_defaults_are_se_names_and_values():
    params = sm.make_prefill_attention("flashprefill_v2").block_sparse_params()
    assert (params.abs_threshold, params.k_block_m, params.k_block_n) == (0.002, 128, 128)
    assert (params.attention_sink_blocks, params.window_blocks, params.last_query_blocks) == (2, 4, 8)
    assert (params.min_sparse_q_len, params.use_mean_correction) == (4096, True)
    assert "flashprefill_v2_abs_threshold" in sm.parameter_fields()
    assert "flashprefill_v2" in sm.prefill_method_names()


def test_method_variants_keep_their_own_field():
    assert sm.make_config("h2o", "flashprefill_v2").prefill_sparse_method is None
    assert sm.build_method("h2o", SHAPE, "flashprefill_v2").prefill_attention is not None
    assert sm.make_config("h2o", "h2o_prefill").prefill_sparse_method == "h2o_prefill"
    assert sm.build_method("h2o", SHAPE, "h2o_prefill").prefill_attention is None


@pytest.mark.parametrize(
    "prefill, params, match",
    [
        ("flashprefill_v2", {"flashprefill_v2_abs_threshold": 1.5}, "flashprefill_v2_abs_threshold"),
        ("flashprefill_v2", {"flashprefill_v2_k_block_n": 96}, "flashprefill_v2_k_block_n"),
        ("flashprefill_v2", {"flashprefill_v2_k_block_m": 24}, "flashprefill_v2_k_block_m"),
        ("flashprefill_v2", {"flashprefill_v2_window_blocks": 0}, "flashprefill_v2_window_blocks"),
        ("flashprefill_v2", {"flashprefill_v2_nope": 1}, "has no parameter"),
        (None, {"flashprefill_v2_abs_threshold": 0.1}, "not chosen"),
        ("h2o_prefill", {"flashprefill_v2_abs_threshold": 0.1}, "not chosen"),
    ],
)
def test_bad_parameters_name_the_field(prefill, params, match):
    with pytest.raises(ValueError, match=match):
        sm.make_config("h2o", prefill, **params)
