"""Qwen3-MoE (Qwen3 technical report, https://arxiv.org/abs/2505.09388): the Qwen3 decoder with routed
experts in place of the dense MLP on the layers ``ModelConfig.mlp_layer_types`` marks ``"sparse"``.

The MoE block is a linear router (``mlp.gate``, no bias), a softmax over all experts, the ``top_k``
largest kept (renormalised to sum to one when ``norm_topk_prob``) and ``FusedExperts``; no shared
expert. Attention (q/k norm), norms and the dense layers are ``llama.py``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from sparse_models.config import ModelConfig
from sparse_models.layers import Linear
from sparse_models.layers.moe import FusedExperts, route_expert_weight
from sparse_models.layers.router import softmax_topk
from sparse_models.models.llama import LlamaForCausalLM
from sparse_models.registry import register_model


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(config.hidden_size, moe.num_experts)
        self.experts = FusedExperts(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H] -> [T, H]``."""
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, ids, weights)


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose sparse layers run ``Qwen3MoeSparseBlock``; per-expert checkpoint
    tensors are stacked into each layer's ``FusedExperts`` at load."""

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
        if config.mlp_layer_types[layer_idx] == "sparse":
            return Qwen3MoeSparseBlock(config)
        return LlamaForCausalLM.make_mlp(config, layer_idx)

    @staticmethod
    def route_checkpoint_name(name: str) -> tuple[str, tuple[int, str]] | None:
        return route_expert_weight(name)
