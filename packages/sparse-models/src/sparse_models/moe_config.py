"""The routed experts' shape, as mixture-of-experts configs say it.

``MoeConfig`` is what ``sparse_models.layers.moe.FusedExperts`` and a family's router need: how many
experts, how many each token goes to, each expert's SwiGLU width, and whether the chosen experts'
weights are renormalised to sum to one. Which layers are MoE is ``ModelConfig.mlp_layer_types``
(``"sparse"``); the others keep the dense MLP of ``intermediate_size``.

DeepSeek-style routers add group-limited selection (experts in ``num_groups`` groups; a token picks
among the experts of its ``topk_group`` best groups), a scoring function (softmax for DeepSeek-V2,
sigmoid plus a selection-only ``e_score_correction_bias`` for V3 and GLM), a factor on the routed
output (``routed_scaling_factor``) and always-on shared experts; Qwen3-MoE keeps the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
_SIGMOID_ROUTERS = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to one
    scoring: str = "softmax"  # "softmax" | "sigmoid" (V3 / GLM, with a selection bias per expert)
    num_groups: int = 1  # expert groups; a token chooses among its topk_group best groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weighted sum
    num_shared_experts: int = 0  # experts every token runs, one SwiGLU of this many times the width


def parse_qwen_moe(raw: dict[str, Any]) -> tuple[MoeConfig, tuple[str, ...]]:
    """``(MoeConfig, mlp_layer_types)`` of a Qwen3-MoE ``config.json`` dict.

    Layer ``i`` is MoE unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
    (HF's rule). transformers 5 writes the expert count as ``num_local_experts``, the published
    checkpoints as ``num_experts``; both are read. Defaults are Qwen3MoeConfig's.
    """
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 128
    step = raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or ())
    layer_types = tuple(
        "sparse" if i not in dense and num_experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(raw["num_hidden_layers"])
    )
    moe = MoeConfig(
        num_experts=int(num_experts),
        top_k=int(raw.get("num_experts_per_tok", 8)),
        intermediate_size=int(raw.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    return moe, layer_types


def parse_deepseek_moe(architecture: str, raw: dict[str, Any]) -> MoeConfig:
    """``MoeConfig`` of a DeepSeek-V2/V3 or Glm4MoeLite ``config.json`` dict (which layers are routed is
    ``mla_config.parse_mlp_layer_types``).

    V2 routes by softmax, greedily or group-limited (``topk_method``); V3 and GLM by sigmoid with a
    selection bias. Absent keys take the family config class's defaults.

    Raises
    ------
    NotImplementedError
        A V2 ``topk_method`` other than ``greedy`` / ``group_limited_greedy``.
    """
    v2 = architecture == "DeepseekV2ForCausalLM"
    defaults = {
        "DeepseekV2ForCausalLM": dict(experts=64, shared=2, top_k=None, scale=1.0, groups=None, norm=False),
        "DeepseekV3ForCausalLM": dict(experts=256, shared=1, top_k=8, scale=2.5, groups=8, norm=True),
        "Glm4MoeLiteForCausalLM": dict(experts=64, shared=1, top_k=4, scale=1.8, groups=1, norm=True),
    }[architecture]
    method = raw.get("topk_method") or "greedy"
    if v2 and method not in ("greedy", "group_limited_greedy"):
        raise NotImplementedError(f"{architecture}: topk_method {method!r} is not supported")
    grouped = not v2 or method == "group_limited_greedy"
    num_groups = (raw.get("n_group") or defaults["groups"] or 1) if grouped else 1
    topk_group = (raw.get("topk_group") or num_groups) if grouped else 1
    return MoeConfig(
        num_experts=int(raw.get("n_routed_experts") or raw.get("num_local_experts") or defaults["experts"]),
        top_k=int(raw.get("num_experts_per_tok") or defaults["top_k"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        # transformers' DeepseekV2 never renormalises (the published V2 configs say false anyway)
        norm_topk_prob=False if v2 else bool(raw.get("norm_topk_prob", defaults["norm"])),
        scoring="softmax" if v2 else "sigmoid",
        num_groups=int(num_groups),
        topk_group=int(topk_group),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or defaults["scale"]),
        num_shared_experts=int(raw.get("n_shared_experts", defaults["shared"]) or 0),
    )
