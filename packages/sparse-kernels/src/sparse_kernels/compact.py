"""Compact each request's kept KV rows to the front of its slot list, per KV head (eviction methods)."""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def compact_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    keep: torch.Tensor,
    *,
    slot_indptr: torch.Tensor | None = None,
    keep_indptr: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Move kept tokens to the front of each request's slot list, per KV head, in place.

    For request ``r`` with slot list ``S = slot_ids[slot_indptr[r]:slot_indptr[r+1]]`` and kept
    positions ``K = keep[:, keep_indptr[r]:keep_indptr[r+1]]`` (``[Hkv, n_keep_r]``), writes, for every
    KV head ``h`` and ``i < n_keep_r``::

        k_cache[S[i], h] = old k_cache[S[K[h, i]], h]   (same for v_cache)

    where "old" is the content before the call. Slots ``S[n_keep_r:]`` keep stale data; the caller
    then shortens the request's table to ``n_keep_r`` tokens and frees the now-unused trailing blocks.

    Parameters
    ----------
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, modified in place. A slot is
        ``block_id * block_size + offset``.
    slot_ids : torch.Tensor
        int32 ``[total_slots]`` on the caches' device: each request's slots in table order, concatenated.
        Slots are distinct.
    keep : torch.Tensor
        int32/int64 ``[num_kv_heads, total_keep]`` on the caches' device: for each request, positions
        into its own slot list; every row of a request's block strictly increasing (as ``topk`` indices
        after ``sort``). Heads may keep different tokens, but the same count. One row shared by every
        head may come as an ``expand`` of it (head stride 0): the kernel reads it without a copy.
    slot_indptr, keep_indptr : torch.Tensor, optional
        int32 ``[R + 1]`` on the caches' device, CSR over requests of ``slot_ids`` and ``keep``'s
        columns. Both None means one request (the whole of ``slot_ids`` and ``keep``).
    backend : str
        ``"auto"``, ``"triton"`` or ``"reference"`` (see ``sparse_kernels.store_kv``).

    Notes
    -----
    Device-only, no host sync. The reference gathers every source before writing, so any order works
    there; the Triton kernel relies on strictly increasing rows (``keep[h, i] >= i``) to compact in place
    without scratch, and with a row that is not increasing its result is undefined.
    """
    slot_indptr, keep_indptr = _check(k_cache, v_cache, slot_ids, keep, slot_indptr, keep_indptr)
    if keep.numel() == 0:
        return
    if resolve_backend(backend, k_cache.device) == "triton":
        from sparse_kernels._triton.compact import compact_kv_triton

        columns = keep if keep.stride(1) == 1 else keep.contiguous()  # a head stride of 0 (expand) stays
        compact_kv_triton(k_cache, v_cache, slot_indptr, slot_ids, keep_indptr, columns)
        return
    num_kv_heads = k_cache.shape[2]
    total_keep = keep.shape[1]
    counts = (keep_indptr[1:] - keep_indptr[:-1]).to(torch.int64)
    req = torch.arange(counts.numel(), device=keep.device)
    req = torch.repeat_interleave(req, counts, output_size=total_keep)  # request of each keep column
    base = slot_indptr.to(torch.int64)[req]  # [total_keep]
    local = torch.arange(total_keep, device=keep.device) - keep_indptr.to(torch.int64)[req]
    ids = slot_ids.to(torch.int64)
    dst = ids[base + local]  # [total_keep]
    src = ids[base[None, :] + keep.to(torch.int64)]  # [Hkv, total_keep]
    heads = torch.arange(num_kv_heads, device=keep.device)[:, None]
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, num_kv_heads, cache.shape[3])  # [num_slots, Hkv, D]
        rows = flat[src, heads]  # [Hkv, total_keep, D]: every source read before any write
        flat[dst[None, :], heads] = rows


def _check(k_cache, v_cache, slot_ids, keep, slot_indptr, keep_indptr) -> tuple[torch.Tensor, torch.Tensor]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be equal [num_blocks, block_size, Hkv, D], got {list(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if slot_ids.dim() != 1 or slot_ids.dtype != torch.int32:
        raise ValueError(f"slot_ids must be a 1-D int32 tensor, got {slot_ids.dtype} {list(slot_ids.shape)}")
    if keep.dim() != 2 or keep.shape[0] != k_cache.shape[2] or keep.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"keep must be int32/int64 [num_kv_heads={k_cache.shape[2]}, n], got {keep.dtype} {list(keep.shape)}"
        )
    if (slot_indptr is None) != (keep_indptr is None):
        raise ValueError("pass both slot_indptr and keep_indptr, or neither")
    if slot_indptr is None:
        device = slot_ids.device
        slot_indptr = torch.tensor([0, slot_ids.numel()], dtype=torch.int32, device=device)
        keep_indptr = torch.tensor([0, keep.shape[1]], dtype=torch.int32, device=device)
        if keep.shape[1] > slot_ids.numel():
            raise ValueError(f"keep has {keep.shape[1]} columns but the slot list only {slot_ids.numel()} slots")
    for name, t in (("slot_indptr", slot_indptr), ("keep_indptr", keep_indptr)):
        if t.dim() != 1 or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a 1-D int32 tensor")
    if slot_indptr.shape != keep_indptr.shape:
        raise ValueError("slot_indptr and keep_indptr must both be [R + 1]")
    return slot_indptr, keep_indptr
