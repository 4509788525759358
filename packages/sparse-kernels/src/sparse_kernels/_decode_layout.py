"""Host-side validation of a decode plan, dense or head-sparse, into one small layout record."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_kernels._paged_validate import (
    check_heads,
    check_paged_kv,
    check_run_tensors,
    check_sm_scale,
    check_window_left,
)


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """What ``run`` checks its inputs against, and the kernels' static shape parameters."""

    batch: int  # requests (rows of q)
    num_lists: int  # batch (dense) or batch * num_kv_heads (head-sparse)
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # of the pool
    page_size: int  # tokens per kv_indices entry: block_size (block ids) or 1 (slot ids), or a divisor
    head_sparse: bool
    num_pages: int  # kv_indptr[-1]
    max_list_len: int  # tokens in the longest list
    sm_scale: float
    window_left: int = -1  # token j of a list (query at j = len - 1) is seen iff j >= len - 1 - window_left

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def scores_shape(self) -> tuple[int, ...]:
        """``scores_out``'s shape: ``[Hkv, num_pages * page_size]`` dense, ``[num_pages * page_size]`` head-sparse."""
        cols = self.num_pages * self.page_size
        return (cols,) if self.head_sparse else (self.num_kv_heads, cols)


def check_decode_plan(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_len: torch.Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sm_scale: float | None,
    head_sparse: bool,
    page_size: int | None,
    window_left: int = -1,
) -> DecodeLayout:
    """Validate a decode plan's arguments (see ``BatchDecodeWithPagedKVCache.plan``)."""
    check_heads(num_qo_heads, num_kv_heads, head_dim, block_size)
    page_size = block_size if page_size is None else page_size
    if not isinstance(page_size, int) or page_size < 1 or block_size % page_size != 0:
        raise ValueError(f"page_size must be a positive divisor of block_size={block_size}, got {page_size!r}")
    _, _ = check_paged_kv(kv_indptr, kv_indices, kv_last_len, page_size)
    lens = (kv_indptr[1:] - kv_indptr[:-1] - 1).to(torch.int64) * page_size + kv_last_len.to(torch.int64)
    num_lists = kv_indptr.numel() - 1
    if head_sparse and num_lists % num_kv_heads != 0:
        raise ValueError(
            f"head-sparse kv_indptr needs B * num_kv_heads + 1 entries (num_kv_heads={num_kv_heads}), "
            f"got {kv_indptr.numel()}"
        )
    return DecodeLayout(
        batch=num_lists // num_kv_heads if head_sparse else num_lists,
        num_lists=num_lists,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        page_size=page_size,
        head_sparse=head_sparse,
        num_pages=int(kv_indptr[-1]),
        max_list_len=int(lens.max()) if lens.numel() else 0,
        sm_scale=check_sm_scale(sm_scale, head_dim),
        window_left=check_window_left(window_left),
    )


def check_logits_out(layout: DecodeLayout, logits_out: torch.Tensor | None) -> None:
    """``logits_out``: float32 ``[B, num_qo_heads, W]`` with a contiguous last dimension, ``W`` at least the
    longest list, for a dense plan without a window (column ``j`` is token ``j`` of the request's list)."""
    if logits_out is None:
        return
    if layout.head_sparse or layout.window_left >= 0:
        raise ValueError("logits_out needs a dense plan (one list per request) without a sliding window")
    lead = (layout.batch, layout.num_qo_heads)
    if (
        logits_out.dtype != torch.float32
        or logits_out.dim() != 3
        or tuple(logits_out.shape[:2]) != lead
        or logits_out.shape[2] < layout.max_list_len
        or (logits_out.numel() and logits_out.stride(2) != 1)
    ):
        raise ValueError(
            f"logits_out must be float32 [{lead[0]}, {lead[1]}, W >= {layout.max_list_len}] with a contiguous last "
            f"dimension, got {logits_out.dtype} {list(logits_out.shape)}"
        )


def check_decode_run(
    layout: DecodeLayout,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scores_out: torch.Tensor | None,
    lse_out: torch.Tensor | None = None,
) -> None:
    """Shape checks against the layout; they read host metadata only, so they stay graph-safe."""
    check_run_tensors(
        q,
        (layout.batch, layout.num_qo_heads, layout.head_dim),
        k_cache,
        v_cache,
        (layout.block_size, layout.num_kv_heads, layout.head_dim),
    )
    if scores_out is not None:
        shape = layout.scores_shape()
        if tuple(scores_out.shape) != shape or scores_out.dtype != torch.float32:
            raise ValueError(
                f"scores_out must be float32 {list(shape)}, got {scores_out.dtype} {list(scores_out.shape)}"
            )
        if scores_out.numel() and scores_out.stride(-1) != 1:
            raise ValueError("scores_out's last dimension must be contiguous")
    check_lse_out(layout, lse_out)


def check_lse_out(layout: DecodeLayout, lse_out: torch.Tensor | None) -> None:
    """``lse_out``: None or a contiguous float32 ``[B, num_qo_heads]``."""
    lse_shape = (layout.batch, layout.num_qo_heads)
    if lse_out is not None and (
        tuple(lse_out.shape) != lse_shape or lse_out.dtype != torch.float32 or not lse_out.is_contiguous()
    ):
        raise ValueError(
            f"lse_out must be a contiguous float32 {list(lse_shape)}, got {lse_out.dtype} {list(lse_out.shape)}"
        )
