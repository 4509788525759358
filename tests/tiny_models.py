"""Tiny random HF models of each family and a plain reference decoder, for cross-package tests."""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval"

_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # large logits: few near-ties, so greedy parity is meaningful
    bos_token_id=1,
    eos_token_id=2,
)


def family_config(family: str):
    import transformers as tf

    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**_COMMON, rope_parameters=rope), tf.LlamaForCausalLM
    if family == "qwen2":
        return tf.Qwen2Config(**_COMMON, tie_word_embeddings=True), tf.Qwen2ForCausalLM
    if family == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=32), tf.Qwen3ForCausalLM
    if family == "mistral":
        return tf.MistralConfig(**_COMMON, sliding_window=None), tf.MistralForCausalLM
    if family == "qwen3_moe":  # layers 0 and 2 routed (8 experts, 2 per token, renormalised), layer 1 dense
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        return tf.Qwen3MoeConfig(**_COMMON, **moe, head_dim=32, mlp_only_layers=[1]), tf.Qwen3MoeForCausalLM
    if family in MLA_FAMILIES:
        return mla_config(family)
    raise KeyError(family)


def mla_config(family: str, **overrides):
    """A multi-head latent attention model of 2 layers: layer 0 a dense MLP, layer 1 routed experts
    (8, 2 per token, one shared; GLM-4.7-Flash: sigmoid over 2 groups); ``overrides`` change the config."""
    import transformers as tf

    config_cls, model_cls, extra = MLA_FAMILIES[family]
    shape = {**_COMMON, "num_hidden_layers": 2, "num_key_value_heads": 4, **_MLA_SHAPE, **extra, **overrides}
    return getattr(tf, config_cls)(**shape), getattr(tf, model_cls)


_MLA_SHAPE = dict(
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
)
MLA_FAMILIES = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(q_lora_rank=None, first_k_dense_replace=1)),
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(q_lora_rank=32, mlp_layer_types=["dense", "sparse"], n_group=2, topk_group=1),
    ),
}


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy decoding: a full forward per token, no KV cache, no EOS stop."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
