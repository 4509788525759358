"""DeepSeek routers: V3 / GLM (sigmoid, grouped, selection bias) and V2 greedy equal HF's routing; V2's
group-limited choice (which HF's DeepseekV2Moe cannot run) equals a per-token reference; the configs
parse to the routing each family means."""

from __future__ import annotations

import pytest
import torch
import transformers

from sparse_models import ModelConfig
from sparse_models.layers.router import deepseek_route

HIDDEN, TOKENS = 16, 33


def _logits(num_experts: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(TOKENS, num_experts, generator=torch.Generator().manual_seed(seed)) * 2


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF picks with ``sorted=False``: compare each token's (id, weight) pairs in id order."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize(
    ("family", "groups", "topk_group", "renormalize"),
    [("DeepseekV3", 4, 2, True), ("DeepseekV3", 8, 3, False), ("Glm4MoeLite", 1, 1, True)],
)
def test_sigmoid_router_matches_hf(family, groups, topk_group, renormalize):
    config = getattr(transformers, f"{family}Config")(
        hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=groups, topk_group=topk_group,
        norm_topk_prob=renormalize, routed_scaling_factor=2.5,
    )  # fmt: skip
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE

    moe = {"DeepseekV3": DeepseekV3MoE, "Glm4MoeLite": Glm4MoeLiteMoE}[family](config)
    bias = torch.rand(16, generator=torch.Generator().manual_seed(1)) * 0.3  # sigmoid + bias stays positive
    moe.gate.e_score_correction_bias.copy_(bias)
    logits = _logits(16)
    hf_ids, hf_weights = moe.route_tokens_to_experts(logits)
    weights, ids = deepseek_route(logits, 4, "sigmoid", groups, topk_group, renormalize, bias)
    ids, weights = _by_id(weights * 2.5, ids)
    hf_ids, hf_weights = _by_id(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


def test_v2_greedy_router_matches_hf():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    config = transformers.DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=12, num_experts_per_tok=3, routed_scaling_factor=1.5
    )
    logits = _logits(12)
    hf_ids, hf_weights = DeepseekV2Moe(config).route_tokens_to_experts(logits[None])
    weights, ids = deepseek_route(logits, 3, "softmax")
    ids, weights = _by_id(weights * 1.5, ids)
    hf_ids, hf_weights = _by_id(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


def test_v2_group_limited_router_matches_a_per_token_reference():
    groups, topk_group, top_k, experts = 4, 2, 3, 16
    logits = _logits(experts, seed=2)
    weights, ids = deepseek_route(logits, top_k, "softmax", groups, topk_group)
    for t in range(TOKENS):
        probs = torch.softmax(logits[t], dim=-1).tolist()
        size = experts // groups
        best = sorted(range(groups), key=lambda g: -max(probs[g * size : (g + 1) * size]))[:topk_group]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        expected = sorted(allowed, key=lambda e: -probs[e])[:top_k]
        assert sorted(ids[t].tolist()) == sorted(expected)
        torch.testing.assert_close(weights[t], torch.tensor([probs[e] for e in ids[t].tolist()]))


def _raw(architecture: str, **extra) -> dict:
    return dict(
        architectures=[architecture], vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        moe_intermediate_size=6, n_routed_experts=8, num_experts_per_tok=2, **extra,
    )  # fmt: skip


def test_configs_parse_each_familys_routing():
    v3 = ModelConfig.from_hf_dict(_raw("DeepseekV3ForCausalLM", n_group=4, topk_group=2, first_k_dense_replace=1))
    assert v3.mlp_layer_types == ("dense", "sparse", "sparse")
    moe = v3.moe
    assert (moe.scoring, moe.num_groups, moe.topk_group, moe.norm_topk_prob) == ("sigmoid", 4, 2, True)
    assert (moe.routed_scaling_factor, moe.num_shared_experts, moe.intermediate_size) == (2.5, 1, 6)
    glm = ModelConfig.from_hf_dict(_raw("Glm4MoeLiteForCausalLM", routed_scaling_factor=1.8)).moe
    assert (glm.scoring, glm.num_groups, glm.routed_scaling_factor) == ("sigmoid", 1, 1.8)
    v2 = ModelConfig.from_hf_dict(_raw("DeepseekV2ForCausalLM", n_group=4, topk_group=1)).moe
    assert (v2.scoring, v2.num_groups, v2.num_shared_experts, v2.norm_topk_prob) == ("softmax", 1, 2, False)
    limited = ModelConfig.from_hf_dict(
        _raw("DeepseekV2ForCausalLM", n_group=4, topk_group=1, topk_method="group_limited_greedy")
    )
    assert (limited.moe.num_groups, limited.moe.topk_group) == (4, 1)
    with pytest.raises(NotImplementedError, match="noaux_tc"):
        ModelConfig.from_hf_dict(_raw("DeepseekV2ForCausalLM", topk_method="noaux_tc"))
    dense = ModelConfig.from_hf_dict(_raw("DeepseekV2ForCausalLM", first_k_dense_replace=3))
    assert dense.moe is None and dense.mlp_layer_types == ("dense",) * 3
