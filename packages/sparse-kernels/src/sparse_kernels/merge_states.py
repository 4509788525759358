"""Merge two attention states over disjoint sets of keys into the one softmax over their union.

An attention state is a query's normalised output over a set ``out = sum_j exp(s_j) v_j / exp(lse)`` and
the natural log of its softmax denominator ``lse = log(sum_j exp(s_j))`` (``-inf`` with ``out = 0`` for an
empty set). Two of them merge exactly: each weighs by its share of the total denominator. FlashInfer's
``merge_state`` does the same. ``merge_states`` is plain torch (a handful of elementwise ops, graph-safe);
``merge_states_`` merges into the first output in place (or into a third tensor), on CUDA in one Triton
launch (the torch ops are a dozen launches, once per layer where a decode merges a second state).
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax over the union of two disjoint sets, from each one's normalised ``out`` ``[..., D]`` and
    ``lse`` ``[...]`` (natural log; one of the two may be ``-inf``, not both)."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None]


def reduce_states(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``S`` states over disjoint sets merged into one: ``out`` ``[..., S, D]``, ``lse`` ``[..., S]`` (natural log,
    ``-inf`` for an empty set) to float32 ``[..., D]`` and ``[...]`` (``-inf`` with ``out = 0`` when every set is
    empty). A split kernel's partial states merge this way."""
    total = torch.logsumexp(lse.float(), dim=-1)
    w = torch.exp(lse.float() - total.clamp_min(torch.finfo(torch.float32).min)[..., None])  # 0 for empty sets
    merged = (torch.where(w[..., None] > 0, out.float(), 0.0) * w[..., None]).sum(-2)
    return merged, total


def merge_states_(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``merge_states`` written into ``out`` (default ``out_a``; any float dtype, the merge runs in float32),
    returned.

    ``out_a`` ``[..., D]``; ``out_b`` ``[..., D]`` (any float dtype) and the two ``lse`` ``[...]`` float32, of the
    same leading shape; ``out`` of ``out_a``'s shape. Triton runs states of 2 or 3 dims with unit stride on ``D``
    (other strides are free: a transposed view merges without a copy), the reference the rest."""
    dst = out_a if out is None else out
    if (
        out_b.shape != out_a.shape
        or dst.shape != out_a.shape
        or lse_a.shape != out_a.shape[:-1]
        or lse_b.shape != lse_a.shape
    ):
        raise ValueError(f"states must share a shape: {tuple(out_a.shape)} / {tuple(out_b.shape)}, lse [...]")
    unit = out_a.stride(-1) == 1 and dst.stride(-1) == 1
    if resolve_backend(backend, out_a.device) == "triton" and unit and out_a.dim() in (2, 3):
        from sparse_kernels._triton.merge_states import merge_states_triton

        return merge_states_triton(out_a, lse_a, out_b, lse_b, dst)
    dst.copy_(merge_states(out_a.float(), lse_a, out_b, lse_b))
    return dst
