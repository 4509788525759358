"""What the quantized decode and prefill wrappers share: checks, TurboQuant's rotation, the reference path.

The reference dequantizes the listed blocks (and, for KIVI, the tail rows of incomplete pages) into a
small dense pool, remaps the plan's entries onto it and runs the plain paged reference over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_kernels._paged_validate import check_index_tensor
from sparse_kernels.quantized_kv import QuantizedKV


def check_tail_index(tail_index: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``tail_index``: None, or int32 CPU ``[B]`` of non-negative tail rows."""
    if tail_index is None:
        return None
    check_index_tensor("tail_index", tail_index)
    if tail_index.numel() != batch:
        raise ValueError(f"tail_index must have B = {batch} entries, got {tail_index.numel()}")
    if tail_index.numel() and int(tail_index.min()) < 0:
        raise ValueError("tail_index entries must be non-negative tail rows")
    return tail_index


def check_quantized_kv(
    kv: QuantizedKV,
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    whole_pages: bool,
    partial_pages: bool,
    tail_index: torch.Tensor | None,
    device: torch.device,
) -> None:
    """Host-only checks of ``kv`` against a plan (graph-safe: no device reads)."""
    if not isinstance(kv, QuantizedKV):
        raise TypeError(f"expected a QuantizedKV, got {type(kv).__name__}")
    got = (kv.block_size, kv.num_kv_heads, kv.head_dim)
    if got != (block_size, num_kv_heads, head_dim):
        raise ValueError(
            f"QuantizedKV (block_size, num_kv_heads, head_dim) must be {(block_size, num_kv_heads, head_dim)} "
            f"as planned, got {got}"
        )
    if kv.device.type != device.type:
        raise ValueError(f"QuantizedKV is on {kv.device}, the wrapper on {device}")
    if kv.scheme == "kivi":
        if not whole_pages:
            raise ValueError(
                "KIVI reads whole pages (keys are quantized per channel over a page): plan lists of whole "
                "blocks (page_size=block_size); per-slot lists need fp8 or turboquant"
            )
        if partial_pages and tail_index is None:
            raise ValueError("KIVI with an incomplete last page needs plan(..., tail_index=...) (rows of kv.k_tail)")
        if tail_index is not None and kv.k_tail is None:
            raise ValueError("tail_index was planned but this QuantizedKV has no tail rows")
    elif tail_index is not None:
        raise ValueError(f"tail_index is for KIVI's incomplete pages; scheme {kv.scheme!r} keeps none")


_rotations: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}  # -> (R, R in that dtype)


def rotate(x: torch.Tensor, kv: QuantizedKV, *, back: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """TurboQuant: ``x @ R`` (into the rotated space) or ``x @ R.T`` (back), in ``x``'s dtype: one matmul.

    ``R`` in ``x``'s dtype is made once per rotation tensor (a constant of the store), so inside a CUDA
    graph captured after a first run no cast is launched; with ``out`` (``x``'s dtype) the product is
    written there.
    """
    key = (kv.rotation.data_ptr(), x.dtype)
    cached = _rotations.get(key)
    if cached is None or cached[0] is not kv.rotation:
        cached = _rotations[key] = (kv.rotation, kv.rotation.to(x.dtype))
    rotation = cached[1].T if back else cached[1]
    if out is not None and out.is_contiguous():
        return torch.matmul(x, rotation, out=out)
    result = torch.matmul(x, rotation)
    return result if out is None else out.copy_(result)


@dataclass(frozen=True, slots=True)
class CompactPool:
    """The listed pages of a plan as a small pool: block ids to dequantize, tail rows, remapped entries."""

    blocks: torch.Tensor  # int64 device [u]: pool blocks, each once, dequantized into compact blocks 0..u-1
    tails: torch.Tensor  # int64 device [t]: KIVI tail rows, compact blocks u..u+t-1
    kv_indices: torch.Tensor  # int32 CPU [nnz]: the plan's entries over the compact pool


def compact_pool(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_len: torch.Tensor,
    tail_index: torch.Tensor | None,
    *,
    block_size: int,
    page_size: int,
    device: torch.device,
    lists_per_request: int = 1,
) -> CompactPool:
    """Remap a validated plan onto the blocks it lists (an entry is a page of ``page_size`` tokens).

    With ``tail_index`` (KIVI, ``page_size == block_size``), the last page of each list whose
    ``kv_last_len`` is short of a page is read from its request's tail row instead of its block: list
    ``l`` belongs to request ``l // lists_per_request`` (head-sparse plans: the KV head count).
    """
    per_block = block_size // page_size
    entries = kv_indices.to(torch.int64)
    is_tail = torch.zeros(entries.numel(), dtype=torch.bool)
    tails = torch.zeros(0, dtype=torch.int64)
    if tail_index is not None:
        partial = (kv_last_len < page_size).nonzero().flatten()
        is_tail[kv_indptr[partial + 1].to(torch.int64) - 1] = True
        tails = tail_index[partial // lists_per_request].to(torch.int64)
    blocks, inverse = torch.unique(entries[~is_tail] // per_block, return_inverse=True)
    remapped = torch.empty_like(entries)
    remapped[~is_tail] = inverse * per_block + entries[~is_tail] % per_block
    remapped[is_tail] = blocks.numel() + torch.arange(tails.numel())
    return CompactPool(blocks.to(device), tails.to(device), remapped.to(torch.int32))


def dequantize_pool(kv: QuantizedKV, pool: CompactPool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``(k, v)`` ``[u + t, S, H, D]`` in ``dtype``: the compact blocks, then the tail rows."""
    from sparse_kernels.kv_quant import dequantize_blocks

    k, v = dequantize_blocks(kv, pool.blocks, dtype=torch.float32, unrotate=True)
    if pool.tails.numel():
        k = torch.cat([k, kv.k_tail[pool.tails].float()])
        v = torch.cat([v, kv.v_tail[pool.tails].float()])
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


def run_dequantized(
    cached,
    kv: QuantizedKV,
    q: torch.Tensor,
    out: torch.Tensor,
    csr,
    tails,
    *,
    block_size: int,
    page_size: int,
    device,
    plan_inner,
    lists_per_request: int = 1,
    **outs,
):
    """The reference of ``run_quantized`` for decode and prefill alike: dequantize only the planned blocks
    (and tail rows) into a small pool and run the plain reference wrapper over it.

    ``csr``: the plan's host ``(kv_indptr, kv_indices, kv_last_len)``; ``plan_inner(kv_indices)`` returns
    a reference wrapper planned over the small pool's indices. ``cached``: this function's previous
    return value for the same plan (or None); the pool and the inner plan are reused while the plan lasts.
    Writes ``out`` (and the decode's optional outputs ``outs``, e.g. ``lse_out`` / ``logits_out``); returns what
    to pass as ``cached`` next time.
    """
    if cached is None or cached[0] != (tails is not None):
        kv_indptr, kv_indices, kv_last_len = csr
        pool = compact_pool(
            kv_indptr, kv_indices, kv_last_len, tails, block_size=block_size, page_size=page_size, device=device,
            lists_per_request=lists_per_request,
        )  # fmt: skip
        cached = (tails is not None, pool, plan_inner(pool.kv_indices))
    _, pool, inner = cached
    k, v = dequantize_pool(kv, pool, torch.float32)
    out.copy_(inner.run(q.float(), k, v, **outs))
    return cached
