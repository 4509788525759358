"""The decode roofline's weight bytes count only the routed experts a step is expected to read, and the
Qwen3-30B-A3B bench config parses to the published shape."""

from __future__ import annotations

import json

import pytest

from sparse_models import load_model, read_model_config
from sparse_serve.bench.command import DEFAULT_BENCH_MODEL
from sparse_serve.bench.probes import weight_bytes_per_step

TINY = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=8, mlp_only_layers=[1], tie_word_embeddings=False,
)  # fmt: skip


def test_only_expected_experts_count(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, _ = load_model(tmp_path, load_format="dummy")
    nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    everything = nbytes(model.parameters()) - nbytes(model.model.embed_tokens.parameters())  # a lookup, untied
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(experts) == 2
    all_experts = sum(nbytes(e.parameters()) for e in experts)
    assert weight_bytes_per_step(model) == everything  # no batch given: every weight
    # One token reads exactly its 4 of 16 experts in each routed layer.
    assert weight_bytes_per_step(model, 1) == everything - all_experts + all_experts * 4 // 16
    expected_8 = 16 * (1 - (12 / 16) ** 8)  # distinct experts of 8 tokens under uniform routing
    assert weight_bytes_per_step(model, 8) == pytest.approx(
        everything - all_experts + all_experts * expected_8 / 16, abs=1
    )
    assert weight_bytes_per_step(model, 10_000) == everything  # a large batch touches them all


def test_qwen3_30b_a3b_config_is_the_published_shape():
    config = read_model_config(DEFAULT_BENCH_MODEL.parent / "qwen3-30b-a3b")
    assert config.architecture == "Qwen3MoeForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (48, 2048, 151936)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (128, 8, 768, True)
    assert config.mlp_layer_types == ("sparse",) * 48 and config.max_position_embeddings >= 128 * 1024 + 2048
