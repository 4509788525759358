"""Gemma 3 text: logits equal HF transformers' (fp32) on tiny random checkpoints with both layer kinds,
a window shorter than the sequences, and Gemma's own numerics; config.json in both layouts."""

from __future__ import annotations

import pytest
import torch
import transformers

from sparse_models import ModelConfig, load_model

ATOL = 1e-4
SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    query_pre_attn_scalar=24,  # not head_dim: a wrong softmax scale would show
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    attn_implementation="eager",
)
SEQ_LENS = (5, 13, 1)


def _hf_gemma(seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config = transformers.Gemma3TextConfig(**{**SHAPE, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-initialises the (1 + w) norms: randomise them so a wrong route shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


@pytest.mark.parametrize(
    "overrides",
    [{}, {"final_logit_softcapping": 3.0, "tie_word_embeddings": False}],
    ids=["tied", "softcap-untied"],
)
def test_gemma3_logits_match_hf(tmp_path, random_batch, our_logits, hf_logits, overrides):
    hf_model = _hf_gemma(**overrides)
    hf_model.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.layer_sliding_windows == (4, None, 4, 4)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is config.tie_word_embeddings
    seqs = random_batch(config.vocab_size, SEQ_LENS)
    expected = hf_logits(hf_model, seqs)
    torch.testing.assert_close(
        our_logits(model, seqs, sliding_window=config.layer_sliding_windows), expected, atol=ATOL, rtol=0
    )
    # The window really cuts: ignoring it changes the 13-token sequence's logits.
    assert not torch.allclose(our_logits(model, seqs, sliding_window=None), expected, atol=ATOL, rtol=0)


def test_gemma3_dummy_weights_run(tmp_path, random_batch, our_logits):
    config = transformers.Gemma3TextConfig(**SHAPE, architectures=["Gemma3ForCausalLM"])
    config.save_pretrained(tmp_path)
    model, config = load_model(tmp_path, load_format="dummy")
    assert all(bool((n.weight == 1).all()) for n in (model.model.norm, model.model.layers[0].self_attn.q_norm))
    logits = our_logits(model, random_batch(config.vocab_size, SEQ_LENS), sliding_window=config.layer_sliding_windows)
    assert logits.isfinite().all()


def _hub_layout(**extra) -> dict:
    """A config.json as transformers 4.5x wrote Gemma 3 1B's (top-level RoPE keys, a window pattern)."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 16,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": None,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
        **extra,
    }


def test_gemma3_hub_layout_parses():
    config = ModelConfig.from_hf_dict(_hub_layout())
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert config.rope_theta == 1_000_000.0 and config.gemma.local_rope_theta == 10_000.0
    assert config.softmax_scale == 16**-0.5 and config.tie_word_embeddings and config.qk_norm


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_gemma3_unsupported_settings_are_errors(extra, match):
    with pytest.raises(NotImplementedError, match=match):
        ModelConfig.from_hf_dict(_hub_layout(**extra))
