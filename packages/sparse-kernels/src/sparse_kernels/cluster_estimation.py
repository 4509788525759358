"""RetroInfer's estimation term: a decode query's softmax over estimated clusters, each standing for
``size`` tokens that share the key ``centroid`` and whose values sum to ``value_sum``.

Per batch row ``b`` and query head ``h`` (KV head ``kv = h // group``), over the row's estimated
clusters ``c`` (``-1`` entries and empty clusters count nothing), with ``s_c = scale * q . centroid_c``:
``lse = log(sum_c size_c * exp(s_c))`` and ``out = sum_c exp(s_c) * value_sum_c / exp(lse)``. Merged
with the exact tokens' ``(out, lse)`` by ``merge_states`` this is the one softmax of
``cluster_attention``; ``lse = -inf`` and ``out = 0`` where a row estimates nothing.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def cluster_estimation(
    query: torch.Tensor,
    centroids: torch.Tensor,
    value_sums: torch.Tensor,
    sizes: torch.Tensor,
    clusters: torch.Tensor,
    *,
    scale: float,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: float32 ``[B, Hq, D]`` and ``[B, Hq]``.

    ``query`` ``[B, Hq, D]``; ``centroids`` ``[H, C, D]`` (any float dtype); ``value_sums`` float32
    ``[H, C, D]``; ``sizes`` int ``[H, C]``; ``clusters`` int64 ``[B, H, E]`` cluster ids (``-1``: none).
    """
    batch, q_heads, dim = query.shape
    heads, count, _ = centroids.shape
    if q_heads % heads or tuple(value_sums.shape) != tuple(centroids.shape) or value_sums.dtype != torch.float32:
        raise ValueError("query heads must be a multiple of KV heads and value_sums float32 like centroids")
    if tuple(sizes.shape) != (heads, count) or clusters.shape[:2] != (batch, heads):
        raise ValueError(f"sizes must be [{heads}, {count}] and clusters [{batch}, {heads}, E]")
    if resolve_backend(backend, query.device) == "triton":
        from sparse_kernels._triton.cluster_estimation import cluster_estimation_triton

        return cluster_estimation_triton(query, centroids, value_sums, sizes, clusters, scale)
    group = q_heads // heads
    valid = clusters >= 0
    ids = clusters.clamp_min(0)
    rows = torch.arange(heads, device=query.device)[None, :, None]
    c = centroids[rows, ids].float()  # [B, H, E, D]
    size = sizes[rows, ids].float().masked_fill(~valid, 0.0)
    q = query.float().view(batch, heads, group, dim)
    s = torch.einsum("bhgd,bhed->bhge", q, c) * scale + size.log()[:, :, None]  # log(size) weighs each cluster
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is estimated
    p = torch.exp(s - lse[..., None].clamp_min(torch.finfo(torch.float32).min)) / size.clamp_min(1)[:, :, None]
    out = torch.einsum("bhge,bhed->bhgd", p, value_sums[rows, ids] * valid[..., None])
    return out.reshape(batch, q_heads, dim), lse.reshape(batch, q_heads)
