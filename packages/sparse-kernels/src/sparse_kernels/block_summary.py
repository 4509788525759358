"""Per-block key summaries for query-aware page selection (Quest), and the page upper bound they give.

Quest (Tang et al., 2024, https://arxiv.org/abs/2406.10774) keeps, per page and KV head, the
elementwise min and max of the page's keys; ``sum_d max(q_d * kmax_d, q_d * kmin_d)`` then bounds
``q . k`` for every key of the page from above, and decode reads only the top pages by that bound.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.quantized_kv import QuantizedKV
from sparse_kernels.summary_codes import encode_summary


def block_summary(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_valid: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Write the elementwise min and max key of each listed block and KV head, in place.

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
    block_ids : torch.Tensor
        int32 or int64 ``[n]`` on the cache's device, distinct block ids to summarise.
    num_valid : torch.Tensor
        int32 or int64 ``[n]``: tokens ``[0, num_valid[i])`` of block ``block_ids[i]`` are summarised.
        Blocks with ``num_valid == 0`` are skipped (their summary rows are left as they were).
    kmin, kmax : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]``, contiguous, caller-owned; rows ``block_ids`` are
        written. Any float dtype: float32, or the cache's dtype (min and max pick existing key values,
        so a summary in the cache dtype is exact and half the size of float32); int8 with ``scale``.
    scale : torch.Tensor, optional
        float32 ``[num_blocks, num_kv_heads]``: write ``summary_codes``' outward-rounded int8 codes into
        ``kmin`` / ``kmax`` and each listed block's scale here.
    backend : str
        ``"auto"``, ``"triton"`` or ``"reference"`` (see ``sparse_kernels.store_kv``).

    Notes
    -----
    Device-only, no host sync. Summaries are recomputed whole, so call it for a block whenever tokens
    are added to it (for decode, the block of each request's newest token).
    """
    _check(k_cache, block_ids, num_valid, kmin, kmax, scale)
    if block_ids.numel() == 0:
        return
    if resolve_backend(backend, k_cache.device) == "triton":
        from sparse_kernels._triton.summary import block_summary_triton

        block_summary_triton(k_cache, block_ids, num_valid, kmin, kmax, scale)
        return
    ids = block_ids.to(torch.int64)
    new_min, new_max = _min_max(k_cache[ids].float(), num_valid)
    _write(ids, num_valid > 0, new_min, new_max, kmin, kmax, scale)


def _write(ids, live, new_min, new_max, kmin, kmax, scale) -> None:
    """Rows ``ids`` of the summaries (codes and scale with ``scale``) from float32 min / max, where ``live``."""
    live = live[:, None]
    if scale is not None:
        new_min, new_max, new_scale = encode_summary(new_min, new_max)
        scale.index_copy_(0, ids, torch.where(live, new_scale, scale[ids]))
    live = live[:, :, None]
    kmin.index_copy_(0, ids, torch.where(live, new_min.to(kmin.dtype), kmin[ids]))
    kmax.index_copy_(0, ids, torch.where(live, new_max.to(kmax.dtype), kmax[ids]))


def quantized_block_summary(
    kv: QuantizedKV,
    block_ids: torch.Tensor,
    num_valid: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """``block_summary`` of a per-token quantized store (fp8, TurboQuant): the elementwise min and max of
    each listed block's *dequantized* keys over its first ``num_valid`` tokens (TurboQuant's rotated back,
    so the summaries bound the original-space query's products with what attention reads), in place.

    ``block_ids`` / ``num_valid``: int ``[n]`` on the store's device. A row with ``num_valid <= 0`` (a
    padded decode row) writes nothing: it repeats row 0's write, so row 0 must be a real one; other ids
    must be distinct. No host sync (a CUDA graph can capture it). With ``scale``, int8 codes as in
    ``block_summary``. fp8 on the Triton backend: ``block_summary``'s kernel, which dequantizes each code
    by its (token, head) scale as it loads it (one launch); otherwise (TurboQuant, the reference) torch ops.
    """
    from sparse_kernels.kv_quant import decode_rows

    if kv.scheme not in ("fp8", "turboquant"):
        raise ValueError(f"block summaries of a {kv.scheme} store are not built (per-token schemes only)")
    if block_ids.numel() == 0:
        return
    if kv.scheme == "fp8" and resolve_backend(backend, kv.k.device) == "triton":
        from sparse_kernels._triton.summary import block_summary_triton

        _check(kv.k, block_ids, num_valid, kmin, kmax, scale)
        block_summary_triton(kv.k, block_ids, num_valid, kmin, kmax, scale, token_scale=kv.k_scale)
        return
    ids = block_ids.to(torch.int64)
    live = num_valid > 0
    ids = torch.where(live, ids, ids[:1])
    keys = decode_rows(kv.k[ids], kv.k_scale[ids], kv.scheme, kv.bits, kv.head_dim, codebook=kv.codebook)
    if kv.scheme == "turboquant":
        keys = keys @ kv.rotation.T.to(keys.device, torch.float32)
    new_min, new_max = _min_max(keys, num_valid)
    row0 = live[:, None, None]
    new_min, new_max = torch.where(row0, new_min, new_min[:1]), torch.where(row0, new_max, new_max[:1])
    _write(ids, torch.ones_like(live), new_min, new_max, kmin, kmax, scale)


def _min_max(keys: torch.Tensor, num_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of ``keys [n, block_size, Hkv, D]`` over each block's first ``num_valid``
    tokens: ``[n, Hkv, D]`` each (+inf / -inf where a block has none)."""
    valid = torch.arange(keys.shape[1], device=keys.device)[None, :] < num_valid[:, None]  # [n, block_size]
    valid = valid[:, :, None, None]
    return keys.masked_fill(~valid, float("inf")).amin(1), keys.masked_fill(~valid, float("-inf")).amax(1)


def block_upper_bound(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> torch.Tensor:
    """Quest's upper bound of ``q . k`` over each listed page, per query head (reference, plain torch).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, num_qo_heads, head_dim]``, one decode query per request.
    kmin, kmax : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]`` from ``block_summary``.
    kv_indptr : torch.Tensor
        int32/int64 ``[B + 1]`` on ``q``'s device: request ``b``'s pages are
        ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    kv_indices : torch.Tensor
        int32/int64 ``[nnz]`` block ids.

    Returns
    -------
    torch.Tensor
        float32 ``[num_qo_heads, nnz]``: column ``i`` is ``sum_d max(q_d * kmax_d, q_d * kmin_d)`` for
        the request owning page ``i`` and each query head, against the page's KV head ``hq // group``.
        Unscaled (``sm_scale`` does not change the order). Aggregate a GQA group as the method needs,
        e.g. ``bound.view(Hkv, group, nnz).amax(1)``.
    """
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if kmin.shape != kmax.shape or kmin.shape[2] != head_dim or num_qo_heads % num_kv_heads:
        raise ValueError(f"incompatible q {list(q.shape)}, kmin {list(kmin.shape)}, kmax {list(kmax.shape)}")
    if kv_indptr.shape != (batch + 1,):
        raise ValueError(f"kv_indptr must be [B + 1] = [{batch + 1}], got {list(kv_indptr.shape)}")
    nnz = kv_indices.numel()
    counts = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    owner = torch.repeat_interleave(torch.arange(batch, device=q.device), counts, output_size=nnz)  # no sync
    group = num_qo_heads // num_kv_heads
    qp = q[owner].float().view(nnz, num_kv_heads, group, head_dim)
    ids = kv_indices.to(torch.int64)
    lo = kmin[ids].float()[:, :, None, :]  # [nnz, Hkv, 1, D]
    hi = kmax[ids].float()[:, :, None, :]
    bound = torch.maximum(qp * hi, qp * lo).sum(-1)  # [nnz, Hkv, group]
    return bound.reshape(nnz, num_qo_heads).T.contiguous()


def _check(k_cache, block_ids, num_valid, kmin, kmax, scale=None) -> None:
    if k_cache.dim() != 4 or not k_cache.is_contiguous():
        raise ValueError(f"k_cache must be a contiguous [num_blocks, block_size, Hkv, D], got {list(k_cache.shape)}")
    num_blocks, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("kmin", kmin), ("kmax", kmax)):
        if tuple(t.shape) != (num_blocks, num_kv_heads, head_dim) or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [{num_blocks}, {num_kv_heads}, {head_dim}], got {list(t.shape)}"
            )
        if scale is None and not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor (int8 codes need their scale), got {t.dtype}")
        if scale is not None and t.dtype != torch.int8:
            raise ValueError(f"{name} must hold int8 codes beside a scale, got {t.dtype}")
    if scale is not None and (
        tuple(scale.shape) != (num_blocks, num_kv_heads) or scale.dtype != torch.float32 or not scale.is_contiguous()
    ):
        raise ValueError(f"scale must be a contiguous float32 [{num_blocks}, {num_kv_heads}], got {list(scale.shape)}")
    if block_ids.dim() != 1 or num_valid.shape != block_ids.shape:
        raise ValueError("block_ids and num_valid must be equal-length 1-D tensors")
    for name, t in (("block_ids", block_ids), ("num_valid", num_valid)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
