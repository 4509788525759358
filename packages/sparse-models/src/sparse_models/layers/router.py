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


def grouped_topk(
    scores: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    group_score: str,
    selection_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek's group-limited choice: the ``top_k`` experts of the best ``topk_group`` of ``num_groups``
    equal groups of consecutive experts (one group: plain top-k).

    Parameters
    ----------
    scores : ``[T, E]`` routing scores (softmax or sigmoid probabilities), fp32.
    group_score : how a group ranks: ``"max"`` (its best expert, DeepSeek-V2) or ``"top2"`` (the sum of
        its two best, DeepSeek-V3 / GLM).
    selection_bias : ``[E]`` added to ``scores`` for choosing only (V3's ``e_score_correction_bias``).

    Returns
    -------
    ``ids [T, top_k]`` int64. Experts outside the chosen groups are out of the running (``-inf``, as
    vLLM; HF zeroes them, which picks one of them instead only when a chosen group's expert has a
    biased score below zero).
    """
    choice = scores if selection_bias is None else scores + selection_bias.float()
    if num_groups > 1:
        groups = choice.view(choice.shape[0], num_groups, -1)  # [T, G, E / G]
        ranked = groups.amax(dim=-1) if group_score == "max" else groups.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ranked.topk(topk_group, dim=-1).indices, True)
        choice = groups.masked_fill(~kept[..., None], float("-inf")).view_as(choice)
    return choice.topk(top_k, dim=-1).indices


def deepseek_route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 (softmax, groups ranked by their best expert) and V3 / GLM-4.7-Flash (sigmoid, groups
    ranked by their two best, a selection bias) routing; the routed-scaling factor is the caller's.

    The weights are the unbiased scores of the chosen experts (renormalised to sum to one when
    ``renormalize``, as V3's ``norm_topk_prob``). ``logits [T, E]`` -> ``(weights [T, k] float32, ids
    [T, k] int64)``.
    """
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    group_score = "max" if scoring == "softmax" else "top2"
    ids = grouped_topk(scores, top_k, num_groups, topk_group, group_score, selection_bias)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids
