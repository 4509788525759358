"""Quest's page upper bounds for a batch of decode queries, read through each row's block table.

For row ``b``, KV head ``h`` and page ``p`` of the row's table, the bound of ``q . k`` over the
page's keys is ``max over the query heads of h's group of sum_d max(q_d * kmax_d, q_d * kmin_d)``
(a page matters if any head of the group may need it). Summaries are read in place through the
table (no gathered copies); pages past the row's length get ``-inf``, pages always kept (the first
``sink`` and the last ``recent`` of the row) get ``+inf``, so a plain top-k over the output picks a
selection. Device-only with a fixed grid (``max_pages`` static), so it can be captured in a CUDA graph.

A KIVI store needs no summaries of its own: its keys are quantized per channel over each full page with
asymmetric min / max, so the page's dequantized keys lie exactly between the page's ``k_min`` and
``k_min + levels * k_scale`` (``levels = 2**bits - 1``; the smallest key of a channel gets code 0, the
largest the top code). ``levels`` takes those statistics in place of ``kmin`` / ``kmax``.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.summary_codes import decode_summary

_OUT_DTYPES = (torch.float32, torch.bfloat16)


def page_bounds(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    table_indices: torch.Tensor,
    table_start: torch.Tensor,
    num_pages: torch.Tensor,
    out: torch.Tensor,
    *,
    sink: int = 0,
    recent: int = 0,
    scale: torch.Tensor | None = None,
    levels: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Write ``out[b, h, p]`` (float32 or bfloat16 ``[B, num_kv_heads, max_pages]``) and return it.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, num_qo_heads, head_dim]``, one decode query per row (rows may be strided).
    kmin, kmax : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]`` block summaries (any float dtype), or their int8 codes
        with ``scale``.
    table_indices : torch.Tensor
        int32 ``[nnz]`` block ids; row ``b``'s table is
        ``table_indices[table_start[b] : table_start[b] + num_pages[b]]``.
    table_start, num_pages : torch.Tensor
        int32 or int64 ``[B]`` on the device; ``1 <= num_pages[b] <= max_pages``.
    out : torch.Tensor
        float32 or bfloat16 ``[B, num_kv_heads, max_pages]``, caller-owned (bounds computed in float32,
        rounded to nearest when stored).
    sink, recent : int
        Pages forced to ``+inf``: ``p < sink`` and ``num_pages - recent <= p < num_pages``.
    scale : torch.Tensor, optional
        float32 ``[num_blocks, num_kv_heads]``: the summaries are int8 codes (``sparse_kernels.summary_codes``)
        standing for ``scale * kmin`` and ``scale * kmax``.
    levels : int
        With ``levels > 0``, ``kmax`` holds each page's per-channel step (non-negative), and a page's
        keys lie in ``[kmin, kmin + levels * kmax]`` (KIVI's key statistics; not with ``scale``).
    """
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if kmin.shape != kmax.shape or kmin.shape[2] != head_dim or num_qo_heads % num_kv_heads:
        raise ValueError(f"incompatible q {list(q.shape)}, kmin {list(kmin.shape)}, kmax {list(kmax.shape)}")
    if out.dim() != 3 or tuple(out.shape[:2]) != (batch, num_kv_heads) or out.dtype not in _OUT_DTYPES:
        raise ValueError(
            f"out must be float32 or bfloat16 [{batch}, {num_kv_heads}, max_pages], got {out.dtype} {list(out.shape)}"
        )
    if scale is not None and (
        kmin.dtype != torch.int8 or kmax.dtype != torch.int8 or tuple(scale.shape) != tuple(kmin.shape[:2])
    ):
        raise ValueError(f"coded summaries are int8 with a scale [{kmin.shape[0]}, {num_kv_heads}]")
    if scale is None and not (kmin.is_floating_point() and kmax.is_floating_point()):
        raise ValueError("int8 summary codes need their scale")
    if levels < 0 or (levels and scale is not None):
        raise ValueError(f"levels must be >= 0 and apply to float (min, step) statistics, got {levels}")
    if table_start.shape != (batch,) or num_pages.shape != (batch,):
        raise ValueError(f"table_start and num_pages must be [B] = [{batch}]")
    if batch == 0:
        return out
    if resolve_backend(backend, q.device) == "triton":
        from sparse_kernels._triton.page_bounds import page_bounds_triton

        return page_bounds_triton(
            q, kmin, kmax, table_indices, table_start, num_pages, out, sink, recent, scale, levels=levels
        )
    max_pages = out.shape[2]
    start = table_start.to(torch.int64)[:, None]
    num_pages = num_pages.to(torch.int64)[:, None]  # [B, 1]
    page = torch.arange(max_pages, device=q.device)[None, :]
    ids = table_indices.to(torch.int64)[start + torch.minimum(page, num_pages - 1)]  # [B, P]
    group = num_qo_heads // num_kv_heads
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    if scale is not None:
        lo, hi = decode_summary(kmin[ids], kmax[ids], scale[ids])
    elif levels:  # (min, step): the page's largest dequantized key per channel is min + levels * step
        lo = kmin[ids].float()
        hi = lo + levels * kmax[ids].float()
    else:
        lo, hi = kmin[ids].float(), kmax[ids].float()
    hi = hi.permute(0, 2, 3, 1)  # [B, Hkv, D, P]
    lo = lo.permute(0, 2, 3, 1)
    bound = (qg.clamp(min=0) @ hi + qg.clamp(max=0) @ lo).amax(2)  # [B, Hkv, P]
    page, num_pages = page[:, None], num_pages[:, :, None]
    forced = (page < sink) | ((page >= num_pages - recent) & (page < num_pages))
    bound = bound.masked_fill(forced, float("inf")).masked_fill(page >= num_pages, float("-inf"))
    out.copy_(bound)
    return out
