"""Quantize new K/V rows into a ``QuantizedKV`` on write (KIVI: through the tail, encoded when a page fills)."""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend
from sparse_kernels.kv_quant import encode_kivi_pages, encode_rows
from sparse_kernels.quantized_kv import QuantizedKV


def store_kv_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    kv: QuantizedKV,
    slot_mapping: torch.Tensor,
    tail_index: torch.Tensor | None = None,
    *,
    one_row_per_request: bool = False,
    static_scales: tuple[float, float] | None = None,
    backend: str = "auto",
) -> None:
    """Encode ``key`` / ``value`` rows into their slots of ``kv``, in place.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[N, num_kv_heads, head_dim]`` in the model dtype, unrotated (TurboQuant rotates them here).
    kv : QuantizedKV
        The layer's store (layouts in ``sparse_kernels.quantized_kv``).
    slot_mapping : torch.Tensor
        int32 ``[N]``: ``slot = block_id * block_size + offset``; ``-1`` marks a padded row that leaves
        every tensor untouched.
    tail_index : torch.Tensor, optional
        int32 ``[N]``, KIVI only: the tail row of each row's request. A row at offset ``o`` goes to
        ``k_tail / v_tail[tail_index, o]``; the row at ``o == block_size - 1`` completes the page, which
        is then encoded into the block's codes and stats (the tail is free again for the next page).
    one_row_per_request : bool
        KIVI: at most one row per request (decode steps). The Triton kernel needs it; it is graph-safe.
    static_scales : tuple of float, optional
        fp8 only: per-layer ``(k_scale, v_scale)`` written as every token's scale instead of dynamic ones.
    backend : str
        ``"auto"``, ``"triton"`` or ``"reference"`` (see ``sparse_kernels.store_kv``).

    Notes
    -----
    fp8 and TurboQuant encode each row alone: both backends are device-only, no host sync. KIVI with
    several rows per request (prefill) runs the plain-torch path on any device, which syncs once to
    find the pages that fill. There, one request's rows must be consecutive positions, adjacent in the
    call (a chunk), and may start mid-page (the earlier tokens are in its tail) and span many pages.
    """
    _check(key, value, kv, slot_mapping, tail_index, static_scales)
    if key.shape[0] == 0:
        return
    triton = resolve_backend(backend, kv.device) == "triton"
    if kv.scheme == "kivi":
        key, value = key.to(kv.k_tail.dtype), value.to(kv.v_tail.dtype)
        if triton and one_row_per_request:
            from sparse_kernels._triton.quantized_store_launch import store_kivi_decode_triton

            store_kivi_decode_triton(key, value, kv, slot_mapping, tail_index)
        else:
            _store_kivi_reference(key, value, kv, slot_mapping, tail_index)
        return
    if kv.scheme == "turboquant":  # a matmul either way: the kernels take the rotated rows
        key, value = key.float() @ kv.rotation, value.float() @ kv.rotation
    if triton:
        from sparse_kernels._triton.quantized_store_launch import store_rows_triton

        store_rows_triton(key, value, kv, slot_mapping, static_scales)
    else:
        _store_rows_reference(key, value, kv, slot_mapping, static_scales)


def _store_rows_reference(key, value, kv, slot_mapping, static_scales) -> None:
    """fp8 / TurboQuant: encode every row, then scatter the real ones (padded rows rewrite a donor's)."""
    num_rows = key.shape[0]
    valid = slot_mapping >= 0
    # As store_kv's reference: padded rows copy the first real row (no host sync to drop them).
    donor = torch.argmax(valid.to(torch.int32))
    rows = torch.where(valid, torch.arange(num_rows, device=key.device), donor)
    slots = slot_mapping.to(torch.int64)[rows]
    keep_old = slots < 0  # only when every row is padding
    safe = slots.clamp(min=0)
    for i, (x, codes, scales) in enumerate(((key, kv.k, kv.k_scale), (value, kv.v, kv.v_scale))):
        static = None if static_scales is None else static_scales[i]
        new_codes, new_scales = encode_rows(x[rows], kv.scheme, kv.bits, codebook=kv.codebook, static_scale=static)
        if codes.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernels: move the bytes
            codes, new_codes = codes.view(torch.uint8), new_codes.view(torch.uint8)
        flat = codes.view(-1, *codes.shape[2:])  # [num_slots, H, W]
        flat.index_copy_(0, safe, torch.where(keep_old[:, None, None], flat[safe], new_codes))
        flat_s = scales.view(-1, scales.shape[2])  # [num_slots, H]
        flat_s.index_copy_(0, safe, torch.where(keep_old[:, None], flat_s[safe], new_scales))


def _store_kivi_reference(key, value, kv, slot_mapping, tail_index) -> None:
    """KIVI for any rows: encode the pages that fill (from the tail and this call's rows), then write
    the rows of still-incomplete pages into their tails."""
    page = kv.block_size
    num_rows = key.shape[0]
    slots = slot_mapping.to(torch.int64)
    tails = tail_index.to(torch.int64)
    offset = slots % page
    # Row i's page fills in this call iff the row at i + (page - 1 - offset) is that page's last slot.
    ahead = torch.arange(num_rows, device=key.device) + (page - 1 - offset)
    fills = (ahead < num_rows) & (slots[ahead.clamp(max=num_rows - 1)] == slots + (page - 1 - offset))
    fills &= slots >= 0
    last = torch.nonzero(fills & (offset == page - 1)).squeeze(1)  # rows that complete a page (host sync)
    if last.numel():
        back = torch.arange(page - 1, -1, -1, device=key.device)  # token j of the page is row last - back[j]
        src = last[:, None] - back[None, :]  # [M, page]
        in_call = (src >= 0) & (slots[src.clamp(min=0)] == slots[last, None] - back[None, :])
        src = src.clamp(min=0)
        tail_tok = (tails[last, None], torch.arange(page, device=key.device)[None, :])
        k_page = torch.where(in_call[..., None, None], key[src], kv.k_tail[tail_tok])  # [M, page, H, D]
        v_page = torch.where(in_call[..., None, None], value[src], kv.v_tail[tail_tok])
        blocks = slots[last] // page
        encoded = encode_kivi_pages(k_page, v_page, kv.bits, kv.group)
        for name, t in zip(("k", "v", "k_scale", "k_min", "v_scale", "v_min"), encoded, strict=True):
            getattr(kv, name).index_copy_(0, blocks, t)
    # Rows of pages still incomplete go to the tail (after the pages above read it).
    pending = (slots >= 0) & ~fills
    rows = torch.where(pending, torch.arange(num_rows, device=key.device), torch.argmax(pending.to(torch.int32)))
    keep_old = ~pending[rows]  # only when no row is pending
    at = (tails[rows].clamp(min=0), offset[rows].clamp(min=0))
    for x, tail in ((key, kv.k_tail), (value, kv.v_tail)):
        tail.index_put_(at, torch.where(keep_old[:, None, None], tail[at], x[rows]))


def _check(key, value, kv, slot_mapping, tail_index, static_scales) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [N, Hkv, D]; got {tuple(key.shape)} and {tuple(value.shape)}")
    if (key.shape[1], key.shape[2]) != (kv.num_kv_heads, kv.head_dim):
        raise ValueError(f"rows have heads/head_dim {tuple(key.shape[1:])}, the store {(kv.num_kv_heads, kv.head_dim)}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int32:
        raise ValueError(
            f"slot_mapping must be int32 [{key.shape[0]}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if kv.scheme == "kivi":
        if tail_index is None or tail_index.shape != slot_mapping.shape or tail_index.dtype != torch.int32:
            raise ValueError("KIVI needs tail_index, int32 [N]: the tail row of each row's request")
    if static_scales is not None and kv.scheme != "fp8":
        raise ValueError(f"static_scales are fp8's per-layer option, not {kv.scheme}'s")
