"""MLA models (DeepSeek-V2/V3, GLM-4.7-Flash) equal HF transformers' logits on tiny random checkpoints
(fp32, dense-only and with routed-expert layers), the absorbed form equals the per-head form it
replaces, and the DeepSeek routers equal HF's (or, for V2's group-limited choice, which HF cannot
run, a per-token reference)."""

from __future__ import annotations

import pytest
import torch
import transformers

from sparse_models import ModelConfig, load_model

ATOL = 1e-4
_SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=256,
    attn_implementation="eager",
)
# name: (config class, model class, overrides); every layer dense (MoE routers come separately)
MLA_FAMILIES = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(q_lora_rank=None, first_k_dense_replace=2)),
    "deepseek_v2_qlora": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(q_lora_rank=24, first_k_dense_replace=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(q_lora_rank=24, first_k_dense_replace=2)),
    "deepseek_v3_halves": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(q_lora_rank=24, first_k_dense_replace=2, rope_interleave=False),
    ),
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(q_lora_rank=24, mlp_layer_types=["dense"] * 2),
    ),
}
_EXPERTS = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, initializer_range=0.1)
# Layer 0 dense, layer 1 routed: V2 greedy softmax; V3 sigmoid over 4 groups of 2 (2 chosen) with a
# selection bias; GLM one group, 2 shared experts, not renormalised.
MOE_FAMILIES = {
    "deepseek_v2_moe": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(_EXPERTS, q_lora_rank=None, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5),
    ),
    "deepseek_v3_moe": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(_EXPERTS, q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1),
    ),
    "glm4_moe_lite_moe": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(_EXPERTS, q_lora_rank=24, mlp_layer_types=["dense", "sparse"], n_shared_experts=2, norm_topk_prob=False),
    ),
}
MLA_FAMILIES.update(MOE_FAMILIES)


def make_mla_model(name: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = MLA_FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**_SHAPE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF sets norms to 1 and biases to 0: randomise them so a wrong route shows
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
        for bname, buf in model.named_buffers():  # V3 / GLM's selection bias starts at zero
            if bname.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    return model


@pytest.mark.parametrize("name", MLA_FAMILIES)
def test_mla_logits_match_hf(name, tmp_path, random_batch, our_logits, hf_logits):
    hf_model = make_mla_model(name)
    hf_model.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.mla is not None and (config.num_key_value_heads, config.head_dim) == (1, 32 + 8)
    assert ("sparse" in config.mlp_layer_types) == (name in MOE_FAMILIES)
    seqs = random_batch(config.vocab_size)
    torch.testing.assert_close(our_logits(model, seqs), hf_logits(hf_model, seqs), atol=ATOL, rtol=0)


def test_config_reports_the_cache_shape_and_layer_kinds():
    raw = make_mla_model("deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1).config.to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    config = ModelConfig.from_hf_dict(raw)
    assert config.mlp_layer_types == ("dense", "sparse", "sparse")
    assert config.mla.cache_dim == 40 and config.mla.interleaved
    assert config.mla.softmax_scale == pytest.approx((16 + 8) ** -0.5)
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelConfig.from_hf_dict(raw)


def test_absorbed_scores_equal_per_head_scores():
    """q_nope . (W_UK c) == (q_nope W_UK) . c, and W_UV (sum p c) == sum p (W_UV c): the identities the model uses."""
    g = torch.Generator().manual_seed(0)
    heads, nope, v, rank, n = 3, 5, 4, 7, 6
    w = torch.randn(heads * (nope + v), rank, generator=g, dtype=torch.float64)
    w_uk, w_uv = w.view(heads, nope + v, rank)[:, :nope], w.view(heads, nope + v, rank)[:, nope:]
    q_nope, c = (
        torch.randn(heads, nope, generator=g, dtype=torch.float64),
        torch.randn(n, rank, generator=g, dtype=torch.float64),
    )
    k_nope = torch.einsum("hnc,lc->lhn", w_uk, c)
    torch.testing.assert_close(
        torch.einsum("hn,lhn->hl", q_nope, k_nope), torch.einsum("hnc,hn,lc->hl", w_uk, q_nope, c)
    )
    p = torch.rand(heads, n, generator=g, dtype=torch.float64)
    per_head = torch.einsum("hl,lhv->hv", p, torch.einsum("hvc,lc->lhv", w_uv, c))
    torch.testing.assert_close(per_head, torch.einsum("hvc,hl,lc->hv", w_uv, p, c))
