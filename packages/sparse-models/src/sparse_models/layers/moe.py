"""Routed SwiGLU experts, all of a layer's in two stacked tensors, run by ``sparse_kernels.fused_moe``.

``FusedExperts`` owns the weights and the kernel call and nothing else: a family's MoE block computes
its own routing (``sparse_models.layers.router``, or its own function returning the same pair) and
adds whatever the family puts beside the routed experts (shared experts, a scaling factor)::

    weights, ids = softmax_topk(self.gate(x), top_k, renormalize)  # [T, k] fp32, [T, k] int64
    y = self.experts(x, ids, weights)  # [T, H]: sum_j weights[t, j] * expert_{ids[t, j]}(x[t])

Parameters follow HF transformers 5's fused layout and names, ``gate_up_proj [E, 2I, H]`` (gate
rows first) and ``down_proj [E, H, I]``, so a checkpoint saved fused loads as is. Checkpoints on the
Hub store one module per expert (``...experts.{e}.gate_proj.weight`` etc.); a model class routes
those names here with ``route_expert_weight`` (its ``route_checkpoint_name``), and the loader hands
each tensor to ``weight_loader`` with the shard id ``(e, "gate" | "up" | "down")``.

Tensor parallelism splits every expert's width ``I`` over the ranks (each rank holds ``I / world`` of
the gate/up rows and the matching down columns of all experts) and sums the outputs. Rather than
``E / world`` whole experts per rank: the router and the kernel stay as they are, and each rank reads
its share of every chosen expert, so decode's weight reads stay balanced however the tokens route
(whole experts per rank would leave the ranks holding the popular experts the slowest).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from sparse_kernels import fused_moe
from sparse_models.distributed import all_reduce, shard
from sparse_models.weights import check_shape, copy_checked

_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs ``H -> I -> H``; each token runs ``top_k`` of them.

    ``top_k`` is the number of experts per token the router picks; the layer itself takes whatever
    ``[T, k]`` it is given, and uses ``top_k`` only to say how many weight bytes a step reads.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.full_intermediate_size = intermediate_size
        self.start, self.intermediate_size = shard(intermediate_size, "moe_intermediate_size")
        local, experts = self.intermediate_size, range(num_experts)
        self.gate_up_proj = self._param((num_experts, 2 * local, hidden_size), experts, ("gate", "up"))
        self.down_proj = self._param((num_experts, hidden_size, local), experts, ("down",))
        self.gate_up_proj.logical_shape = (num_experts, 2 * intermediate_size, hidden_size)
        self.down_proj.logical_shape = (num_experts, hidden_size, intermediate_size)

    def _param(self, shape: tuple[int, ...], experts: range, projs: tuple[str, ...]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape), requires_grad=False)
        param.weight_loader = self.weight_loader
        param.shard_ids = tuple((e, p) for e in experts for p in projs)  # the loader names what is left out
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Load a whole stacked tensor (``shard_id`` None), or one expert's gate / up / down matrix
        (``(e, "gate" | "up" | "down")``, as ``route_expert_weight`` names it); each keeps this rank's
        width slice."""
        if shard_id is None:
            check_shape(loaded, param.logical_shape)
            if param is self.down_proj:
                copy_checked(param.data, loaded.narrow(2, self.start, self.intermediate_size))
                return
            full = self.full_intermediate_size
            for e in range(self.num_experts):
                self.weight_loader(param, loaded[e, :full], (e, "gate"))
                self.weight_loader(param, loaded[e, full:], (e, "up"))
            return
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: this layer has {self.num_experts}")
        if (proj == "down") != (param is self.down_proj):
            raise ValueError(f"{proj}_proj of expert {expert} does not belong to this parameter")
        rows = {
            "gate": slice(0, self.intermediate_size),
            "up": slice(self.intermediate_size, None),
            "down": slice(None),
        }
        axis = 1 if proj == "down" else 0  # the width I: gate/up rows, down columns
        if loaded.dim() != 2 or loaded.shape[axis] != self.full_intermediate_size:
            raise ValueError(
                f"{proj}_proj of expert {expert}: checkpoint has {tuple(loaded.shape)}, width "
                f"{self.full_intermediate_size} expected"
            )
        mine = loaded.narrow(axis, self.start, self.intermediate_size)
        copy_checked(param.data[expert, rows[proj]], mine)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]``, ``topk_ids [T, k]`` int, ``topk_weights [T, k]`` float -> ``[T, H]`` in
        ``hidden``'s dtype: each token's experts' outputs weighted and summed."""
        return all_reduce(fused_moe(hidden, self.gate_up_proj, self.down_proj, topk_ids, topk_weights))

    def bytes_read(self, num_tokens: int) -> float:
        """Expected weight bytes one forward over ``num_tokens`` tokens reads, under uniform routing.

        Each token picks ``k`` distinct experts of ``E``; an expert is left unread by all ``B`` tokens
        with probability ``(1 - k/E)^B``, so ``E * (1 - (1 - k/E)^B)`` experts are read on average.
        """
        per_expert = sum(p[0].numel() * p.element_size() for p in (self.gate_up_proj, self.down_proj))
        read = self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)
        return read * per_expert


def route_expert_weight(name: str) -> tuple[str, tuple[int, str]] | None:
    """A per-expert checkpoint name -> ``(stacked parameter name, shard id)``, None for any other name.

    ``model.layers.3.mlp.experts.17.up_proj.weight`` -> ``("model.layers.3.mlp.experts.gate_up_proj",
    (17, "up"))``; ``down_proj`` goes to ``...experts.down_proj`` with ``(17, "down")``.
    """
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    proj = match["proj"]
    stacked = "down_proj" if proj == "down" else "gate_up_proj"
    return f"{match['prefix']}.{stacked}", (int(match["expert"]), proj)
