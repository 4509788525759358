"""ModelConfig parsing: both RoPE layouts, family defaults, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from sparse_models import ModelConfig, RopeScaling, UnsupportedArchitectureError, read_model_config

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPE = dict(
    max_position_embeddings=16384,
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def _written_by_hf(config: transformers.PretrainedConfig, tmp_path) -> dict:
    """The config.json transformers writes (a model's save adds ``architectures``; a config's alone does not)."""
    config.architectures = [config.model_type.capitalize() + "ForCausalLM"]
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="transformers 4 writes the legacy layout")
def test_transformers5_writes_rope_parameters(tmp_path):
    """Pins the layout we parse: HF 5 folds rope_theta and rope_scaling into rope_parameters."""
    raw = _written_by_hf(
        transformers.LlamaConfig(**SHAPE, rope_theta=5e5, rope_scaling={"rope_type": "llama3", **LLAMA3}), tmp_path
    )
    assert "rope_theta" not in raw and "rope_scaling" not in raw
    assert raw["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}


@pytest.mark.parametrize("legacy_type_key", ["rope_type", "type"])
def test_rope_layouts_parse_equal(tmp_path, legacy_type_key):
    new = _written_by_hf(
        transformers.LlamaConfig(**SHAPE, rope_theta=5e5, rope_scaling={"rope_type": "llama3", **LLAMA3}), tmp_path
    )
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy.update(rope_theta=5e5, rope_scaling={legacy_type_key: "llama3", **LLAMA3})
    parsed = ModelConfig.from_hf_dict(new)
    assert parsed == ModelConfig.from_hf_dict(legacy)
    assert parsed.rope_theta == 5e5
    assert parsed.rope_scaling == RopeScaling("llama3", **LLAMA3)


def test_default_rope_layouts_parse_equal(tmp_path):
    new = _written_by_hf(transformers.Qwen2Config(**SHAPE, rope_theta=1e6), tmp_path)
    assert new["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"} | {"rope_theta": 1e6, "rope_scaling": None}
    assert ModelConfig.from_hf_dict(new) == ModelConfig.from_hf_dict(legacy)
    assert ModelConfig.from_hf_dict(new).rope_scaling is None


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_unsupported_rope_type(tmp_path, rope_type):
    raw = _written_by_hf(transformers.LlamaConfig(**SHAPE), tmp_path)
    raw["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(NotImplementedError, match=rope_type):
        ModelConfig.from_hf_dict(raw)


def test_family_traits(tmp_path):
    qwen2 = ModelConfig.from_hf_dict(_written_by_hf(transformers.Qwen2Config(**SHAPE), tmp_path))
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelConfig.from_hf_dict(_written_by_hf(transformers.Qwen3Config(**SHAPE), tmp_path))
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 128)
    llama = ModelConfig.from_hf_dict(_written_by_hf(transformers.LlamaConfig(**SHAPE, attention_bias=True), tmp_path))
    assert (llama.attention_bias, llama.attention_out_bias, llama.head_dim) == (True, True, 16)


def test_sliding_window(tmp_path):
    mistral = ModelConfig.from_hf_dict(_written_by_hf(transformers.MistralConfig(**SHAPE, sliding_window=32), tmp_path))
    assert mistral.sliding_window == 32 and mistral.layer_sliding_windows == (32, 32)
    no_window = ModelConfig.from_hf_dict(
        _written_by_hf(transformers.MistralConfig(**SHAPE, sliding_window=None), tmp_path)
    )
    assert no_window.sliding_window is None and no_window.layer_sliding_windows == (None, None)
    # Qwen2 configs carry a sliding_window that is off unless use_sliding_window says otherwise.
    raw = _written_by_hf(transformers.Qwen2Config(**SHAPE), tmp_path)
    assert ModelConfig.from_hf_dict(raw | {"sliding_window": 4096}).sliding_window is None
    legacy_on = {k: v for k, v in raw.items() if k != "layer_types"}
    legacy_on |= {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}
    assert ModelConfig.from_hf_dict(legacy_on).layer_sliding_windows == (None, 16)


def test_token_ids_and_defaults(tmp_path):
    raw = _written_by_hf(transformers.LlamaConfig(**SHAPE), tmp_path)
    raw.update(eos_token_id=[128001, 128009], bos_token_id=128000, torch_dtype="bfloat16")
    raw.pop("dtype", None), raw.pop("head_dim"), raw.pop("num_key_value_heads")
    config = ModelConfig.from_hf_dict(raw)
    assert config.eos_token_ids == (128001, 128009) and config.bos_token_id == 128000
    assert config.torch_dtype == torch.bfloat16
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert ModelConfig.from_hf_dict(raw | {"eos_token_id": 2}).eos_token_ids == (2,)
    assert ModelConfig.from_hf_dict(raw | {"eos_token_id": None}).eos_token_ids == ()


def test_unsupported_architecture_lists_supported(tmp_path):
    raw = _written_by_hf(transformers.LlamaConfig(**SHAPE), tmp_path) | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict(raw)


def test_read_model_config(tmp_path):
    _written_by_hf(transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True), tmp_path)
    config = read_model_config(tmp_path)
    assert config.architecture == "Qwen3ForCausalLM" and config.tie_word_embeddings
    with pytest.raises(FileNotFoundError):
        read_model_config(tmp_path / "nowhere")
