"""Routers: router logits -> each token's experts and their weights, for ``FusedExperts``.

A router function takes the gate's logits ``[T, E]`` and returns ``(topk_weights [T, k] float32,
topk_ids [T, k] int64)``; the MoE block multiplies any family-specific factor into the weights.
"""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the ``top_k`` largest; ``renormalize`` rescales the kept
    weights to sum to one (Qwen3-MoE's ``norm_topk_prob``; Mixtral always, Qwen2-MoE by config).

    Parameters
    ----------
    logits : ``[T, E]`` router logits, any float dtype.
    top_k : experts per token, ``1 <= top_k <= E``.
    renormalize : divide the kept weights by their sum.

    Returns
    -------
    ``(weights [T, k] float32, ids [T, k] int64)``, each row in descending weight.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
