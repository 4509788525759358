"""RetroInfer's cluster ranking logits, read straight from a cluster arena: per decode row, KV head and
query head of its group, ``q . centroid * scale`` over the row's ``columns`` cluster columns.

Row ``r``'s clusters are the arena columns ``bases[r] + c`` for ``c < columns`` (clamped to the arena);
columns at or past ``counts[r]`` and empty clusters (size 0) get logit ``-inf`` and size 0. With them come
softmax statistics over tiles of columns, per query head: each tile's largest logit and the sum of
``exp(logit - that max)`` (0 and max ``-inf`` for a tile with no live cluster), which ``cluster_select``
merges instead of reading the logits twice. The reference gathers the rows' centroids and multiplies in
float32, with one tile of all the columns; the Triton kernel reads each centroid tile once per group from
the arena (no gathered copy), accumulates its dot products in float32 and has one tile per program.

Centroids may be stored as int8 codes with a float32 scale per (KV head, cluster) (``encode_centroids``: the
scale is the centroid's largest magnitude over 127, codes rounded to nearest), half the bytes the ranking reads
each step; the centroid they stand for is ``scale * code`` (``decode_centroids``), and the logits are those of
that centroid: ``(q . code) * scale`` (the Triton kernel dots the codes as exact fp16 values against the query
in fp16, which holds a bf16 query exactly within fp16's normal range).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.summary_codes import CODE_MAX, code_scale


class ClusterLogits(NamedTuple):
    logits: torch.Tensor  # float32 [n, H, G, columns]
    sizes: torch.Tensor  # int32 [n, H, columns]
    tile_max: torch.Tensor  # float32 [n, H, G, tiles]
    tile_sum: torch.Tensor  # float32 [n, H, G, tiles]


def cluster_logits(
    query: torch.Tensor,
    centroids: torch.Tensor,
    sizes: torch.Tensor,
    bases: torch.Tensor,
    counts: torch.Tensor,
    columns: int,
    *,
    scale: float,
    centroid_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> ClusterLogits:
    """``(logits, sizes, tile_max, tile_sum)``: float32 ``[n, H, G, columns]``, int32 ``[n, H, columns]`` and the
    tiles' softmax statistics, float32 ``[n, H, G, tiles]``.

    ``query`` ``[n, H * G, D]``; ``centroids`` ``[H, C, D]`` (the arena's, any float dtype); ``sizes`` int32
    ``[H, C]``; ``bases`` and ``counts`` int ``[n]`` (a row's first column and its number of clusters).
    int8 ``centroids`` are codes and need their ``centroid_scale`` float32 ``[H, C]`` (``encode_centroids``).
    """
    n, q_heads, dim = query.shape
    heads, total, _ = centroids.shape
    if q_heads % heads or tuple(sizes.shape) != (heads, total):
        raise ValueError(f"query heads must be a multiple of {heads} KV heads and sizes [{heads}, {total}]")
    if (centroids.dtype == torch.int8) != (centroid_scale is not None):
        raise ValueError("int8 centroids (codes) need their centroid_scale, and only they take one")
    if centroid_scale is not None and tuple(centroid_scale.shape) != (heads, total):
        raise ValueError(f"centroid_scale must be [{heads}, {total}], got {tuple(centroid_scale.shape)}")
    if columns < 1 or bases.shape[0] < n or counts.shape[0] < n:
        raise ValueError("columns must be positive and bases / counts cover every row")
    if resolve_backend(backend, query.device) == "triton":
        from sparse_kernels._triton.cluster_logits import cluster_logits_triton

        return ClusterLogits(
            *cluster_logits_triton(query, centroids, sizes, bases[:n], counts[:n], columns, scale, centroid_scale)
        )
    c = torch.arange(columns, device=query.device)
    cid = (bases[:n, None] + c).clamp_(max=total - 1)  # [n, Cw]
    valid = c[None] < counts[:n, None]
    size = sizes[:, cid].permute(1, 0, 2).masked_fill(~valid[:, None], 0).to(torch.int32)  # [n, H, Cw]
    q = query.float().view(n, heads, -1, dim)
    if centroid_scale is not None:
        centroids = decode_centroids(centroids, centroid_scale)
    logits = torch.einsum("nhgd,nhcd->nhgc", q, centroids[:, cid].permute(1, 0, 2, 3).float()) * scale
    logits.masked_fill_((size == 0)[:, :, None], float("-inf"))
    return ClusterLogits(logits, size, *softmax_statistics(logits))


def softmax_statistics(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile of all the columns: ``(max, sum of exp(logit - max))`` ``[..., 1]`` (0 where all are ``-inf``)."""
    top = logits.amax(-1, keepdim=True)
    return top, (logits - top.nan_to_num(neginf=0.0)).exp().sum(-1, keepdim=True)


def encode_centroids(centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes ``[..., D]`` and float32 scales ``[...]`` of ``centroids`` ``[..., D]``: ``scale = amax / 127``
    (1 for an all-zero centroid; ``summary_codes.code_scale``), codes ``round(x / scale)`` (IEEE division, ties to
    even)."""
    x = centroids.float()
    scale = code_scale(x.abs().amax(-1))
    return torch.round(x / scale[..., None]).clamp_(-CODE_MAX, CODE_MAX).to(torch.int8), scale


def decode_centroids(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 centroids ``scale * code`` that codes stand for."""
    return codes.float() * scale[..., None]
