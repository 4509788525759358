"""A batched selection's entries as pool entries: what the head-sparse decode plan's index list holds.

A query-aware method picks, per decode row and KV head, ``S`` entries in its row's table order
(pages of ``block_size`` tokens, or single tokens); the decode kernel reads pool block ids (or slot
ids). This maps one to the other through the row's block table in one launch, clamping entries past
the row's length to its last page / token (a CUDA graph's padding rows pick such entries), and
writes the int32 ids straight into the caller's buffer (the plan's index list). Graph-safe.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def selection_entries(
    chosen: torch.Tensor,
    table_indices: torch.Tensor,
    table_start: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    block_size: int,
    page_size: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Write ``out[b, h, j]`` (int32) for entry ``chosen[b, h, j]`` of row ``b`` and return ``out``.

    Parameters
    ----------
    chosen : torch.Tensor
        int32/int64 ``[B, H, S]`` in table order, any strides (e.g. expanded over ``H``).
    table_indices : torch.Tensor
        int32 block ids; row ``b``'s table starts at ``table_start[b]``.
    table_start, kv_lens : torch.Tensor
        int ``[B]``: where each row's table starts, and its tokens (``>= 1``).
    out : torch.Tensor
        int32 ``[B, H, S]``, contiguous.
    block_size : int
        Tokens per pool block.
    page_size : int
        ``block_size``: entries are pages, ``out`` holds block ids. ``1``: entries are tokens, ``out``
        holds slot ids ``block * block_size + offset``.
    """
    if chosen.dim() != 3 or tuple(out.shape) != tuple(chosen.shape) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 {list(chosen.shape)} like chosen [B, H, S], got {list(out.shape)}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if page_size not in (1, block_size):
        raise ValueError(f"page_size must be 1 or block_size ({block_size}), got {page_size}")
    batch = chosen.shape[0]
    if table_start.shape != (batch,) or kv_lens.shape != (batch,):
        raise ValueError(f"table_start and kv_lens must be [B] = [{batch}]")
    if out.numel() == 0:
        return out
    if resolve_backend(backend, chosen.device) == "triton":
        from sparse_kernels._triton.selection_entries import selection_entries_triton

        return selection_entries_triton(chosen, table_indices, table_start, kv_lens, out, block_size, page_size)
    c = chosen.to(torch.int64)
    start = table_start.to(torch.int64).view(-1, 1, 1)
    lens = kv_lens.to(torch.int64).view(-1, 1, 1)
    if page_size == block_size:
        page = torch.minimum(c, (lens + block_size - 1) // block_size - 1)
        ids = table_indices[start + page]
    else:
        tok = torch.minimum(c, lens - 1)
        ids = table_indices[start + tok // block_size].to(torch.int64) * block_size + tok % block_size
    out.copy_(ids)
    return out
