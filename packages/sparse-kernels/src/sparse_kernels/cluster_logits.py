"""RetroInfer's cluster ranking logits, read straight from a cluster arena: per decode row, KV head and
query head of its group, ``q . centroid * scale`` over the row's ``columns`` cluster columns.

Row ``r``'s clusters are the arena columns ``bases[r] + c`` for ``c < columns`` (clamped to the arena);
columns at or past ``counts[r]`` and empty clusters (size 0) get logit ``-inf`` and size 0. The reference
gathers the rows' centroids and multiplies in float32; the Triton kernel reads each centroid tile once per
group from the arena (no gathered copy) and accumulates its dot products in float32.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def cluster_logits(
    query: torch.Tensor,
    centroids: torch.Tensor,
    sizes: torch.Tensor,
    bases: torch.Tensor,
    counts: torch.Tensor,
    columns: int,
    *,
    scale: float,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, sizes)``: float32 ``[n, H, G, columns]`` and int32 ``[n, H, columns]``.

    ``query`` ``[n, H * G, D]``; ``centroids`` ``[H, C, D]`` (the arena's, any float dtype); ``sizes`` int32
    ``[H, C]``; ``bases`` and ``counts`` int ``[n]`` (a row's first column and its number of clusters).
    """
    n, q_heads, dim = query.shape
    heads, total, _ = centroids.shape
    if q_heads % heads or tuple(sizes.shape) != (heads, total):
        raise ValueError(f"query heads must be a multiple of {heads} KV heads and sizes [{heads}, {total}]")
    if columns < 1 or bases.shape[0] < n or counts.shape[0] < n:
        raise ValueError("columns must be positive and bases / counts cover every row")
    if resolve_backend(backend, query.device) == "triton":
        from sparse_kernels._triton.cluster_logits import cluster_logits_triton

        return cluster_logits_triton(query, centroids, sizes, bases[:n], counts[:n], columns, scale)
    c = torch.arange(columns, device=query.device)
    cid = (bases[:n, None] + c).clamp_(max=total - 1)  # [n, Cw]
    valid = c[None] < counts[:n, None]
    size = sizes[:, cid].permute(1, 0, 2).masked_fill(~valid[:, None], 0).to(torch.int32)  # [n, H, Cw]
    q = query.float().view(n, heads, -1, dim)
    logits = torch.einsum("nhgd,nhcd->nhgc", q, centroids[:, cid].permute(1, 0, 2, 3).float()) * scale
    return logits.masked_fill_((size == 0)[:, :, None], float("-inf")), size
