"""The routed experts' shape, as mixture-of-experts configs say it.

``MoeConfig`` is what ``sparse_models.layers.moe.FusedExperts`` and a family's router need: how many
experts, how many each token goes to, each expert's SwiGLU width, and whether the chosen experts'
weights are renormalised to sum to one. Which layers are MoE is ``ModelConfig.mlp_layer_types``
(``"sparse"``); the others keep the dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to one


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
