"""Host-side validation of paged-attention plan inputs (CSR block tables, head layout)."""

from __future__ import annotations

import torch


def check_index_tensor(name: str, t: torch.Tensor) -> None:
    """Require a 1-D int32 CPU tensor: plan reads it on the host."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (plan runs on the host), got device {t.device}")


def check_window_left(window_left: int) -> int:
    """A sliding window's ``window_left``: a query at ``p`` sees keys ``p - window_left .. p``; -1: none."""
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1 (-1: no window), got {window_left!r}")
    return window_left


def check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Validate the head layout and block size."""
    for name, value in (
        ("num_qo_heads", num_qo_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_indptr(name: str, indptr: torch.Tensor, what: str) -> torch.Tensor:
    """Validate a CSR row pointer whose every row is non-empty; return the row lengths (int64 [B])."""
    check_index_tensor(name, indptr)
    if indptr.numel() < 2:
        raise ValueError(f"{name} must have B + 1 >= 2 entries (at least one request), got {indptr.numel()}")
    if int(indptr[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(indptr[0])}")
    lengths = (indptr[1:] - indptr[:-1]).to(torch.int64)
    shortest = int(lengths.min())  # one reduction: plan runs every step on long lists
    if shortest < 0:
        raise ValueError(f"{name} must be non-decreasing")
    if shortest == 0:
        bad = int(torch.nonzero(lengths == 0)[0])
        raise ValueError(f"request {bad} has no {what}; every request needs at least one")
    return lengths


def check_paged_kv(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_len: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a paged-KV CSR table.

    Returns
    -------
    num_blocks : torch.Tensor
        int64 ``[B]``, blocks held by each request.
    kv_lens : torch.Tensor
        int64 ``[B]``, ``(num_blocks - 1) * block_size + kv_last_len``.
    """
    num_blocks = check_indptr("kv_indptr", kv_indptr, "KV block")
    check_index_tensor("kv_indices", kv_indices)
    check_index_tensor("kv_last_len", kv_last_len)
    batch = num_blocks.numel()
    if int(kv_indptr[-1]) != kv_indices.numel():
        raise ValueError(f"kv_indptr[-1] ({int(kv_indptr[-1])}) must equal len(kv_indices) ({kv_indices.numel()})")
    # min / max reductions: several times cheaper than elementwise compares on 10^4-10^5 entries.
    if kv_indices.numel() and int(kv_indices.min()) < 0:
        raise ValueError("kv_indices must be non-negative block ids")
    if kv_last_len.numel() != batch:
        raise ValueError(f"kv_last_len must have B = {batch} entries, got {kv_last_len.numel()}")
    lo, hi = (int(x) for x in kv_last_len.aminmax())
    if lo < 1 or hi > block_size:
        raise ValueError(f"kv_last_len entries must be in [1, block_size={block_size}]")
    kv_lens = (num_blocks - 1) * block_size + kv_last_len.to(torch.int64)
    return num_blocks, kv_lens


def check_qo_fits(qo_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
    """Queries are the last ``qo_len`` KV positions, so they cannot outnumber them."""
    if qo_lens.numel() != kv_lens.numel():
        raise ValueError(f"qo_indptr has {qo_lens.numel()} requests but kv_indptr has {kv_lens.numel()}")
    too_long = qo_lens > kv_lens
    if bool(too_long.any()):
        b = int(torch.nonzero(too_long)[0])
        raise ValueError(
            f"request {b}: qo_len ({int(qo_lens[b])}) exceeds kv_len ({int(kv_lens[b])}); "
            "the new tokens' K/V must be stored (and counted in kv_last_len) before attention"
        )


def check_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    """Resolve the default scale and reject non-positive ones."""
    if sm_scale is None:
        return head_dim**-0.5
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale!r}")
    return float(sm_scale)


def check_run_tensors(
    q: torch.Tensor,
    expected_q: tuple[int, int, int],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    expected_block: tuple[int, int, int],
) -> None:
    """A run's query and cache shapes against its plan (host metadata only, so graph-safe)."""
    if tuple(q.shape) != expected_q:
        raise ValueError(f"q must be {list(expected_q)} as planned, got {list(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be equal [num_blocks, block_size, Hkv, D]; got "
            f"{list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    if tuple(k_cache.shape[1:]) != expected_block:
        raise ValueError(f"cache block shape must be {list(expected_block)} as planned, got {list(k_cache.shape[1:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
