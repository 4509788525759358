"""Merge two attention states over disjoint sets of keys into the one softmax over their union.

An attention state is a query's normalised output over a set ``out = sum_j exp(s_j) v_j / exp(lse)`` and
the natural log of its softmax denominator ``lse = log(sum_j exp(s_j))`` (``-inf`` with ``out = 0`` for an
empty set). Two of them merge exactly: each weighs by its share of the total denominator. FlashInfer's
``merge_state`` does the same; here it is plain torch (a handful of elementwise ops, graph-safe).
"""

from __future__ import annotations

import torch


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax over the union of two disjoint sets, from each one's normalised ``out`` ``[..., D]`` and
    ``lse`` ``[...]`` (natural log; one of the two may be ``-inf``, not both)."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None]
