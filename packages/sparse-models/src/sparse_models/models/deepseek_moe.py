"""The routed MLP of DeepSeek-V2/V3 and GLM-4.7-Flash (DeepSeekMoE, https://arxiv.org/abs/2401.06066):
fine-grained routed experts plus shared experts that every token runs.

``y = routed_scaling_factor * sum_j w_j expert_{i_j}(x) + shared(x)``, the ``(w, i)`` from
``layers.router.deepseek_route`` over the fp32 gate logits (HF computes them in fp32 too: near-equal
logits in bf16 would flip choices). V3 and GLM keep a per-expert ``e_score_correction_bias`` beside
the gate weight, used to choose experts but not to weigh them; it stays fp32 whatever the model dtype.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from sparse_models.config import ModelConfig
from sparse_models.layers import Linear
from sparse_models.layers.moe import FusedExperts
from sparse_models.layers.router import deepseek_route
from sparse_models.models.llama import MLP


class DeepseekMoeGate(Linear):
    """The router's ``weight [E, hidden]`` (no bias) and, for sigmoid routers, ``e_score_correction_bias [E]``."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.moe.num_experts)
        self.e_score_correction_bias = None
        if config.moe.scoring == "sigmoid":
            bias = torch.zeros(config.moe.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> fp32 logits ``[T, E]``."""
        return F.linear(x.float(), self.weight.float())


class DeepseekMoe(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = self.moe = config.moe
        self.gate = DeepseekMoeGate(config)
        self.experts = FusedExperts(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size)
        self.shared_experts = None
        if moe.num_shared_experts:
            shared_width = moe.intermediate_size * moe.num_shared_experts
            self.shared_experts = MLP(dataclasses.replace(config, intermediate_size=shared_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H] -> [T, H]``."""
        moe = self.moe
        weights, ids = deepseek_route(
            self.gate(x),
            moe.top_k,
            moe.scoring,
            moe.num_groups,
            moe.topk_group,
            moe.norm_topk_prob,
            self.gate.e_score_correction_bias,
        )
        y = self.experts(x, ids, weights * moe.routed_scaling_factor)
        return y if self.shared_experts is None else y + self.shared_experts(x)
