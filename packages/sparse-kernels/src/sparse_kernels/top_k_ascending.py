"""The ``k`` largest entries of each row, returned as ascending column indices (no sort pass).

A query-aware method that keeps "the best ``k`` pages" and then needs them in table order (the
decode kernel reads a list's newest page last) would run a top-k and then a sort. Here one program
per row finds the ``k``-th largest value from the values' ordered bit patterns (counting passes over
the row, held in registers: one bit per pass, or several with every digit's count in one reduction),
then writes the chosen columns in ascending order through a prefix sum of the chosen mask. Ties at
the threshold go to the lower column, as in a stable descending sort
(``sparse_methods.keep_selection.keep_indices``' rule); ``-0.0`` equals ``0.0``. Wide rows go through
per-tile candidates first, spread over many programs (the Triton module's ``CONFIG`` picks the select
and the tiles); rows the kernel cannot take (``fits``) use the reference. Fixed grids, no host sync:
graph-safe.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def top_k_ascending(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, *, backend: str = "auto"):
    """Indices ``[..., k]`` (int64, ascending per row) of the ``k`` largest of ``scores[..., N]``.

    Parameters
    ----------
    scores : torch.Tensor
        float32 or bfloat16 ``[..., N]`` with ``N >= k``, no NaN. bfloat16 scores (a selection that
        ranks by 8 significant bits) take half the radix passes: their keys are 16 bits wide.
    k : int
        Entries per row, ``1 <= k <= N``.
    out : torch.Tensor, optional
        int64 ``[..., k]``, contiguous, written in place.
    """
    n = scores.shape[-1]
    if scores.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"scores must be float32 or bfloat16, got {scores.dtype}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    shape = (*scores.shape[:-1], k)
    if out is None:
        out = torch.empty(shape, dtype=torch.int64, device=scores.device)
    elif tuple(out.shape) != shape or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous int64 {list(shape)}, got {out.dtype} {list(out.shape)}")
    if out.numel() == 0:
        return out
    if resolve_backend(backend, scores.device) == "triton":
        from sparse_kernels._triton.top_k_ascending import fits, top_k_ascending_triton

        if fits(n, k):
            top_k_ascending_triton(scores.reshape(-1, n), k, out.view(-1, k))
            return out
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    out.copy_(torch.sort(order, dim=-1).values)
    return out
