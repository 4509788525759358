"""Write new K/V rows into the paged per-layer pool (device-only, graph-safe): Triton kernel + reference.

The same launch can also copy the step's first query rows into a caller's buffer at given rows
(``copy_rows`` / ``copy_into`` / ``copy_index``): the engine's ring of recent decode queries is written
there at every decode step, which would otherwise cost a launch of its own per layer. Likewise ``summary``:
a decode step's block summaries (Quest's per-page key min / max) updated through the stored keys, what
``update_block_summaries`` would do in a launch of its own right after the store.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.summary_update import check_summary_args, update_block_summaries


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    copy_rows: torch.Tensor | None = None,
    copy_into: torch.Tensor | None = None,
    copy_index: torch.Tensor | None = None,
    summary: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    backend: str = "auto",
) -> None:
    """Scatter ``key``/``value`` rows into their pool slots, in place; optionally copy rows elsewhere too.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[N, num_kv_heads, head_dim]``, the step's new K (RoPE already applied) and V.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous; written in place.
    slot_mapping : torch.Tensor
        ``[N]`` int32 on the caches' device; ``slot = block_id * block_size + offset``. ``-1`` marks
        a padded row (CUDA-graph batch buckets) that must leave the pool untouched.
    copy_rows, copy_into, copy_index : torch.Tensor, optional
        All three or none: ``copy_into[copy_index[i]] = copy_rows[i]`` for every ``i < len(copy_rows)``
        (at most ``N`` rows, unit stride over the last dim; ``copy_into`` ``[R, *copy_rows.shape[1:]]``,
        contiguous, same dtype; ``copy_index`` int64 on the device, distinct rows).
    summary : tuple, optional
        ``(kmin, kmax, scale)``: block summaries to update through the stored keys, exactly as
        ``update_block_summaries(k_cache, slot_mapping, kmin, kmax, scale=scale)`` right after the store
        would (its contract: a decode step, at most one valid slot per block; ``scale`` None for float
        summaries, float32 ``[num_blocks, Hkv]`` with int8 ``kmin`` / ``kmax`` codes). The Triton backend
        does it in the store's launch (int8 codes: when ``head_dim`` and ``Hkv * head_dim`` are powers of
        two and ``block_size <= 32``; otherwise the separate summary kernel follows the store).
    backend : str
        ``"auto"`` (Triton on CUDA, reference on CPU; ``SPARSE_KERNELS_BACKEND`` overrides),
        ``"triton"`` or ``"reference"``.

    Notes
    -----
    No host sync on either path. The Triton kernel runs one program per row and returns at once for
    ``-1``. The reference never materialises the valid subset: padded rows are redirected to the slot and
    data of a real row of the same call, so the duplicate writes carry identical values and their
    order cannot matter. If every row is padding, all rows rewrite slot 0 with its own current
    contents. Two *real* rows with the same slot are a caller error (which one lands is undefined).
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    copy = _check_copy(copy_rows, copy_into, copy_index, key.shape[0])
    if summary is not None:
        kmin, kmax, scale = summary
        check_summary_args(k_cache, slot_mapping, kmin, kmax, scale)
    if key.shape[0] == 0:
        return
    if resolve_backend(backend, k_cache.device) == "triton":
        from sparse_kernels._triton.store import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, copy, summary)
        return
    store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
    if copy is not None:
        rows, into, index = copy
        into.index_copy_(0, index[: rows.shape[0]], rows)
    if summary is not None:
        update_block_summaries(k_cache, slot_mapping, kmin, kmax, scale=scale, backend="reference")


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch ``store_kv`` (inputs already checked, at least one row)."""
    num_rows = key.shape[0]
    valid = slot_mapping >= 0  # [N]
    # argmax returns the first maximal index: the first real row, or row 0 when none is real.
    donor = torch.argmax(valid.to(torch.int32))
    rows = torch.where(valid, torch.arange(num_rows, device=key.device), donor)  # [N]
    slots = slot_mapping.to(torch.int64)[rows]  # all >= 0 unless the whole call is padding
    keep_old = (slots < 0).view(-1, 1, 1)
    safe_slots = slots.clamp(min=0)
    for src, cache in ((key, k_cache), (value, v_cache)):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])  # [num_slots, Hkv, D], aliases the pool
        new = torch.where(keep_old, flat[safe_slots], src[rows].to(cache.dtype))
        flat.index_copy_(0, safe_slots, new)


def _check_copy(rows, into, index, num_rows: int) -> tuple | None:
    given = [t is not None for t in (rows, into, index)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("copy_rows, copy_into and copy_index go together")
    if rows.shape[0] > num_rows or rows.shape[1:] != into.shape[1:] or rows.dtype != into.dtype:
        raise ValueError(
            f"copy_rows {rows.dtype} {tuple(rows.shape)} must be at most {num_rows} rows shaped like copy_into's "
            f"{into.dtype} {tuple(into.shape)}"
        )
    if not into.is_contiguous() or rows.stride(-1) != 1:
        raise ValueError("copy_into must be contiguous and copy_rows have unit stride over its last dim")
    if index.dtype != torch.int64 or index.dim() != 1 or index.shape[0] < rows.shape[0]:
        raise ValueError(f"copy_index must be int64 [>= {rows.shape[0]}]; got {index.dtype} {tuple(index.shape)}")
    if not (rows.device == into.device == index.device):
        raise ValueError("copy_rows, copy_into and copy_index must share a device")
    return rows, into, index


def _check(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # Shape/dtype checks read host-side metadata only, so they stay graph-safe.
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [N, Hkv, D]; got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous so a flat slot view aliases the pool")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int32:
        raise ValueError(
            f"slot_mapping must be int32 [{key.shape[0]}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
