"""RetroInfer's estimation term: a decode query's softmax over estimated clusters, each standing for
``size`` tokens that share the key ``centroid`` and whose values sum to ``value_sum``.

Per batch row ``b`` and query head ``h`` (KV head ``kv = h // group``), over the row's estimated
clusters ``c`` (``-1`` entries and empty clusters count nothing), with ``s_c = scale * q . centroid_c``:
``lse = log(sum_c size_c * exp(s_c))`` and ``out = sum_c exp(s_c) * value_sum_c / exp(lse)``. Merged
with the exact tokens' ``(out, lse)`` by ``merge_states`` this is the one softmax of
``cluster_attention``; ``lse = -inf`` and ``out = 0`` where a row estimates nothing.

Two ways to get ``s_c``. From the centroids (the plain reference): each estimated cluster's centroid is
read and multiplied by the query. From the ranking's logits (``logits=``, ``sparse_kernels.cluster_logits``,
``q . centroid_c * logits_scale`` for every cluster column of the row, already computed to pick the
clusters): ``s_c = logits[b, kv, g, c - bases[b]] * (scale / logits_scale)``, so the query and the
centroids are not read at all, only 4 bytes per query head of the group (16 at G = 4) instead of the
centroid (256 bytes in bf16 at D = 128) beside the value sum (256 bytes in bf16, 512 in float32). There a
column outside ``[0, columns)`` or with logit ``-inf`` (``cluster_logits``' columns past a row's count, empty clusters)
counts nothing either. Both give the same result up to the dot products' rounding.
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
    logits: torch.Tensor | None = None,
    bases: torch.Tensor | None = None,
    logits_scale: float | None = None,
    partial: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: float32 ``[B, Hq, D]`` and ``[B, Hq]``; with ``partial``, ``S`` states over disjoint parts
    of the estimated clusters, ``[B, Hq, S, D]`` and ``[B, Hq, S]``, that ``merge_states.reduce_states`` (or
    ``BatchDecodeWithPagedKVCache.run(merge_with=...)``) merges into that one (the Triton path's splits, left
    unmerged: one launch less; the reference gives ``S = 1``).

    ``query`` ``[B, Hq, D]``; ``centroids`` ``[H, C, D]`` (any float dtype); ``value_sums`` ``[H, C, D]``
    (float32, or a 16-bit float: read as float32, summed in float32); ``sizes`` int ``[H, C]``; ``clusters``
    int64 ``[B, H, E]`` cluster ids (``-1``: none).

    With ``logits`` float32 ``[B, H, Hq // H, columns]`` (``cluster_logits``' at scale ``logits_scale``; row
    ``b``'s column ``c`` is cluster ``bases[b] + c``, ``bases`` int ``[>= B]``) the scores come from them and
    the query and centroids give only the shapes.
    """
    batch, q_heads, dim = query.shape
    heads, count, _ = centroids.shape
    if q_heads % heads or tuple(value_sums.shape) != tuple(centroids.shape) or not value_sums.is_floating_point():
        raise ValueError("query heads must be a multiple of KV heads and value_sums floats shaped like centroids")
    if tuple(sizes.shape) != (heads, count) or clusters.shape[:2] != (batch, heads):
        raise ValueError(f"sizes must be [{heads}, {count}] and clusters [{batch}, {heads}, E]")
    group = q_heads // heads
    if logits is not None:
        if bases is None or logits_scale is None or bases.shape[0] < batch:
            raise ValueError("logits need the rows' bases (one per row) and the scale they were computed at")
        if logits.shape[:3] != (batch, heads, group) or logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32 [{batch}, {heads}, {group}, columns]")
        bases, ratio = bases[:batch], float(scale) / float(logits_scale)
    if resolve_backend(backend, query.device) == "triton":
        from sparse_kernels._triton.cluster_estimation import cluster_estimation_triton

        factor = scale if logits is None else ratio  # multiplies q . centroid, or the logits
        return cluster_estimation_triton(query, centroids, value_sums, sizes, clusters, factor, logits, bases, partial)
    valid = clusters >= 0
    if logits is not None:
        columns = logits.shape[-1]
        col = clusters - bases.to(clusters.dtype)[:, None, None]
        valid &= (col >= 0) & (col < columns)
        col = col.clamp(0, columns - 1)[:, :, None].expand(batch, heads, group, -1)
        s = logits.gather(-1, col) * ratio  # [B, H, G, E]; -inf stays -inf
    ids = torch.where(valid, clusters, 0)
    rows = torch.arange(heads, device=query.device)[None, :, None]
    size = sizes[rows, ids].float().masked_fill(~valid, 0.0)
    if logits is None:
        c = centroids[rows, ids].float()  # [B, H, E, D]
        q = query.float().view(batch, heads, group, dim)
        s = torch.einsum("bhgd,bhed->bhge", q, c) * scale
    s = s + size.log()[:, :, None]  # log(size) weighs each cluster; -inf where it counts nothing
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is estimated
    p = torch.exp(s - lse[..., None].clamp_min(torch.finfo(torch.float32).min)) / size.clamp_min(1)[:, :, None]
    out = torch.einsum("bhge,bhed->bhgd", p, value_sums[rows, ids].float() * valid[..., None])
    out, lse = out.reshape(batch, q_heads, dim), lse.reshape(batch, q_heads)
    return (out[:, :, None], lse[:, :, None]) if partial else (out, lse)
