"""Block summaries updated from a step's slot mapping, on the device and without host metadata.

``block_summary`` recomputes listed blocks from their keys, which needs the list of touched blocks
(host-built per step). A decode step writes one token per request, each into a block no other token
of the step touches, so each written block's summary follows from the new key alone: a slot at
offset 0 of its block starts the block (summary = the key), any other slot widens it (elementwise
min / max with the key). ``update_block_summaries`` does that straight from the slot mapping, which
a CUDA graph can keep in a static buffer (slot ``-1``: a padding row, skipped).
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.block_summary import block_summary


def update_block_summaries(
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Fold each stored key into its block's min / max summary, in place (after ``store_kv``).

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, already holding the new keys.
    slot_mapping : torch.Tensor
        int32 or int64 ``[n]``: pool slots written this step (``block * block_size + offset``); ``-1``
        entries are skipped. No two valid slots may share a block (one token per block per call: a
        decode step), and a block's earlier tokens must already be summarised.
    kmin, kmax : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]``, contiguous summaries (any float dtype; min and max
        pick existing key values, so the cache dtype is exact).
    backend : str
        ``"auto"``, ``"triton"`` or ``"reference"``.

    Notes
    -----
    Device-only and sync-free on the Triton backend (a fixed grid over ``slot_mapping``), so it can
    be captured in a CUDA graph. Equal to ``block_summary`` of each touched block over its valid
    tokens ``[0, offset]``.
    """
    check_summary_args(k_cache, slot_mapping, kmin, kmax, scale)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if slot_mapping.numel() == 0:
        return
    triton = resolve_backend(backend, k_cache.device) == "triton"
    if scale is not None:  # codes: re-summarize each written block through its new token (a fresh encoding)
        if triton:
            from sparse_kernels._triton.summary import block_summary_triton

            block_summary_triton(k_cache, slot_mapping, slot_mapping, kmin, kmax, scale, from_slots=True)
            return
        slots = slot_mapping.to(torch.int64)
        slots = slots[slots >= 0]  # padding rows write nothing (and must not alias a real block)
        block_summary(
            k_cache, slots // block_size, slots % block_size + 1, kmin, kmax, scale=scale, backend="reference"
        )
        return
    if triton:
        from sparse_kernels._triton.summary_update import update_block_summaries_triton

        update_block_summaries_triton(k_cache, slot_mapping, kmin, kmax)
        return
    slots = slot_mapping.to(torch.int64)
    slots = slots[slots >= 0]
    block, offset = slots // block_size, slots % block_size
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots]  # [n, Hkv, D]
    fresh = (offset == 0)[:, None, None]
    keys = keys.to(kmin.dtype)
    kmin[block] = torch.where(fresh, keys, torch.minimum(kmin[block], keys))
    kmax[block] = torch.where(fresh, keys, torch.maximum(kmax[block], keys))


def check_summary_args(
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    scale: torch.Tensor | None,
) -> None:
    """``update_block_summaries``' argument checks (host metadata only, graph-safe); also ``store_kv``'s
    for its ``summary``. Raises ValueError."""
    if k_cache.dim() != 4 or not k_cache.is_contiguous():
        raise ValueError(f"k_cache must be a contiguous [num_blocks, block_size, Hkv, D], got {list(k_cache.shape)}")
    num_blocks, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("kmin", kmin), ("kmax", kmax)):
        if tuple(t.shape) != (num_blocks, num_kv_heads, head_dim) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{num_blocks}, {num_kv_heads}, {head_dim}]")
        if (scale is not None) != (t.dtype == torch.int8):
            raise ValueError(f"{name}: int8 summary codes go with a scale, float summaries without (got {t.dtype})")
    if scale is not None and (tuple(scale.shape) != (num_blocks, num_kv_heads) or scale.dtype != torch.float32):
        raise ValueError(f"scale must be a float32 [{num_blocks}, {num_kv_heads}], got {list(scale.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be a 1-D int32/int64 tensor")
