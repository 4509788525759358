"""Compact each request's kept tokens of a ``QuantizedKV`` to the front of its slot list, per KV head.

fp8 and TurboQuant keep codes and scales per token, so their rows move as ``compact_kv`` moves bf16
rows (the same kernel, on byte / word views). KIVI's key statistics span a page, so its kept tokens
are dequantized, and the full pages re-encoded in place, the incomplete rest written to the tail.
"""

from __future__ import annotations

import torch

from sparse_kernels.compact import _check, compact_kv
from sparse_kernels.kv_quant import encode_kivi_pages, unpack_codes
from sparse_kernels.quantized_kv import QuantizedKV


def compact_quantized(
    kv: QuantizedKV,
    slot_ids: torch.Tensor,
    keep: torch.Tensor,
    *,
    slot_indptr: torch.Tensor | None = None,
    keep_indptr: torch.Tensor | None = None,
    tail_index: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """``compact_kv`` for a quantized store: for request ``r``, KV head ``h`` and ``i < n_keep_r``,
    token ``S[i]`` of head ``h`` becomes old token ``S[K[h, i]]`` (``S``, ``K`` as in ``compact_kv``).

    Parameters
    ----------
    kv : QuantizedKV
        The layer's store, modified in place.
    slot_ids, keep, slot_indptr, keep_indptr, backend
        As ``sparse_kernels.compact_kv`` (int32 CSR over requests; ``keep`` rows strictly increasing).
    tail_index : torch.Tensor, optional
        KIVI only: int32 ``[R]``, each request's tail row. There a request's slot list must be its
        whole sequence in table order: full pages first, then the tokens of its incomplete last page,
        which live in the tail. After the call its first ``n_keep_r // block_size`` pages hold the
        re-encoded kept tokens and its tail row the remaining ``n_keep_r % block_size``.

    Notes
    -----
    fp8 / TurboQuant: device-only, no host sync, Triton or reference as ``compact_kv``. KIVI:
    plain torch on any device (eager; it syncs to size the pages); a kept token is its dequantized
    value in the tail's dtype, so full pages are re-encoded from those values.
    """
    slot_indptr, keep_indptr = _check(kv.k, kv.v, slot_ids, keep, slot_indptr, keep_indptr)
    if kv.scheme != "kivi":
        byte_view = kv.scheme == "fp8"  # Triton and index_put move fp8 as bytes
        codes = [t.view(torch.uint8) if byte_view else t for t in (kv.k, kv.v)]
        scales = [t.unsqueeze(-1) for t in (kv.k_scale, kv.v_scale)]  # [B, S, H, 1]
        for k_t, v_t in (codes, scales):
            compact_kv(k_t, v_t, slot_ids, keep, slot_indptr=slot_indptr, keep_indptr=keep_indptr, backend=backend)
        return
    if tail_index is None or tail_index.dtype != torch.int32 or tail_index.shape != (slot_indptr.numel() - 1,):
        raise ValueError("KIVI compaction needs tail_index, int32 [R]: each request's tail row")
    if keep.numel():
        _compact_kivi(kv, slot_ids, keep.to(torch.int64), slot_indptr, keep_indptr, tail_index)


def _compact_kivi(kv, slot_ids, keep, slot_indptr, keep_indptr, tail_index) -> None:
    page, device = kv.block_size, kv.device
    slot_lo, keep_lo = slot_indptr.cpu().tolist(), keep_indptr.cpu().tolist()
    total_keep = keep.shape[1]
    req = torch.repeat_interleave(
        torch.arange(len(slot_lo) - 1), torch.tensor(keep_lo).diff(), output_size=total_keep
    ).to(device)  # the request of each keep column
    ids = slot_ids.to(torch.int64)
    lo = slot_indptr.to(torch.int64)
    full = (lo[1:] - lo[:-1]) // page * page  # list positions below this are in the codes, the rest in the tail
    src_slots = ids[lo[req][None, :] + keep]  # [H, total_keep]
    in_tail = keep >= full[req][None, :]
    heads = torch.arange(kv.num_kv_heads, device=device)[:, None]
    tails = tail_index.to(torch.int64)[req][None, :]
    k_new, v_new = _kivi_tokens(kv, src_slots, heads)  # [H, total_keep, D], float32
    k_new = torch.where(in_tail[..., None], kv.k_tail[tails, src_slots % page, heads].float(), k_new)
    v_new = torch.where(in_tail[..., None], kv.v_tail[tails, src_slots % page, heads].float(), v_new)
    k_new, v_new = k_new.to(kv.k_tail.dtype).transpose(0, 1), v_new.to(kv.v_tail.dtype).transpose(0, 1)
    # Every source is read; now the writes: full pages of kept tokens, then each request's remainder.
    page_cols, page_blocks, rest_cols, rest_rows = [], [], [], []
    tail_rows = tail_index.cpu().tolist()
    for r in range(len(slot_lo) - 1):
        n_keep = keep_lo[r + 1] - keep_lo[r]
        for p in range(n_keep // page):
            page_cols.append(range(keep_lo[r] + p * page, keep_lo[r] + (p + 1) * page))
            page_blocks.append(slot_lo[r] + p * page)  # the list position of the page's first slot
        rest = range(keep_lo[r] + n_keep // page * page, keep_lo[r + 1])
        rest_cols += rest
        rest_rows += [(tail_rows[r], j) for j in range(len(rest))]
    if page_cols:
        cols = torch.tensor([list(c) for c in page_cols], device=device)  # [P, page]
        blocks = ids[torch.tensor(page_blocks, device=device)] // page
        encoded = encode_kivi_pages(k_new[cols], v_new[cols], kv.bits, kv.group)
        for name, t in zip(("k", "v", "k_scale", "k_min", "v_scale", "v_min"), encoded, strict=True):
            getattr(kv, name).index_copy_(0, blocks, t)
    if rest_cols:
        cols = torch.tensor(rest_cols, device=device)
        at = tuple(torch.tensor(x, device=device) for x in zip(*rest_rows, strict=True))
        kv.k_tail[at] = k_new[cols]
        kv.v_tail[at] = v_new[cols]


def _kivi_tokens(kv: QuantizedKV, slots: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized KIVI tokens of full pages: ``slots`` ``[H, n]`` of head ``heads`` ``[H, 1]`` -> float32
    ``(k, v)`` ``[H, n, D]`` (only the token's own codes and its page's / group's statistics are read)."""
    page, dim = kv.block_size, kv.head_dim
    block, offset = slots // page, slots % page
    k = unpack_codes(kv.k[block, offset, heads], kv.bits, dim).float()
    k = k * kv.k_scale[block, heads].float() + kv.k_min[block, heads].float()
    v = unpack_codes(kv.v[block, offset, heads], kv.bits, dim).float().unflatten(-1, (-1, kv.group))
    v = v * kv.v_scale[block, offset, heads][..., None].float() + kv.v_min[block, offset, heads][..., None].float()
    return k, v.flatten(-2)
