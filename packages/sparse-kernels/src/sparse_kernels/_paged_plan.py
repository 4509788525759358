"""Host-side planning for the reference paged attention: tile the batch and build device index tensors.

A tile is a group of requests of similar length (or a query chunk of one long request) padded to a common
``[bt, nq]`` query grid and ``[bt, nk]`` key grid, so ``run`` is a few batched gathers and matmuls
per tile with no host sync. Tiles are sized so each one's float32 working set stays under a cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedTile:
    """Device index tensors of one tile (``bt`` requests, ``nq`` query rows, ``nk`` key positions)."""

    q_rows: torch.Tensor  # int64 [bt, nq]: row of q for each padded query (clamped into the request)
    slots: torch.Tensor  # int64 [bt, nk]: pool slot of each key position (padding -> a real slot)
    masked: torch.Tensor  # bool [bt, 1, 1, nq, nk]: True where the score must be -inf
    src_rows: torch.Tensor  # int64 [n]: rows of the flattened [bt * nq] tile output that are real
    dst_rows: torch.Tensor  # int64 [n]: where those rows go in out [T]


@dataclass(frozen=True, slots=True)
class PagedPlan:
    """Everything ``run`` needs; built once per step by ``plan``."""

    tiles: tuple[PagedTile, ...]
    num_qo_tokens: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sm_scale: float


def tile_cost(batch: int, num_q: int, num_k: int, num_qo_heads: int, kv_row_elems: int) -> int:
    """float32 elements a tile holds: scores (and probs) plus the gathered K and V."""
    return 2 * batch * num_qo_heads * num_q * num_k + 2 * batch * num_k * kv_row_elems


def split_tiles(
    qo_lens: list[int], kv_lens: list[int], num_qo_heads: int, kv_row_elems: int, max_elems: int
) -> list[tuple[list[int], int, int]]:
    """Greedy tiling: ``(requests, q0, q1)`` = those requests, query rows ``[q0, q1)`` of each.

    Requests are visited longest first so similar lengths share a tile; a tile grows while its
    padded cost fits ``max_elems`` and wastes at most half of it on padding. A request too large on
    its own is cut into query chunks (never below one row, so one row of a huge request may exceed
    the cap: the reference does not split along keys).
    """
    order = sorted(range(len(qo_lens)), key=lambda b: (kv_lens[b], qo_lens[b]), reverse=True)
    tiles: list[tuple[list[int], int, int]] = []
    i = 0
    while i < len(order):
        b = order[i]
        group, max_q, max_k = [b], qo_lens[b], kv_lens[b]
        real = tile_cost(1, max_q, max_k, num_qo_heads, kv_row_elems)
        i += 1
        if real > max_elems:
            rows = max(1, (max_elems - 2 * max_k * kv_row_elems) // (2 * num_qo_heads * max_k))
            tiles.extend(([b], q0, min(q0 + rows, max_q)) for q0 in range(0, max_q, rows))
            continue
        while i < len(order):
            nxt = order[i]
            q, k = max(max_q, qo_lens[nxt]), max(max_k, kv_lens[nxt])
            cost = tile_cost(len(group) + 1, q, k, num_qo_heads, kv_row_elems)
            real_next = real + tile_cost(1, qo_lens[nxt], kv_lens[nxt], num_qo_heads, kv_row_elems)
            if cost > max_elems or cost > 2 * real_next:
                break
            group, max_q, max_k, real = [*group, nxt], q, k, real_next
            i += 1
        tiles.append((group, 0, max_q))
    return tiles


def build_tile(
    bounds: tuple[list[int], int, int],
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_blocks: torch.Tensor,
    kv_lens: torch.Tensor,
    block_size: int,
    causal: bool,
    device: torch.device,
    window_left: int = -1,
) -> PagedTile:
    """Build one tile's index tensors on the host (vectorised), then copy them to ``device``.

    ``window_left >= 0``: a query at position ``p`` sees keys ``p - window_left .. p`` only.
    """
    requests, q0, q1 = bounds
    req = torch.tensor(requests, dtype=torch.int64)  # [bt]
    qo_start = qo_indptr.to(torch.int64)[req, None]  # [bt, 1]
    qo_len = qo_indptr.to(torch.int64)[req + 1, None] - qo_start
    kv_len = kv_lens[req, None]
    row = torch.arange(q0, q1, dtype=torch.int64)[None, :]  # [1, nq]
    real_q = row < qo_len  # [bt, nq]
    # Padded query rows reuse the request's last query so they see >= 1 key (no all -inf softmax rows).
    row_c = torch.minimum(row, qo_len - 1)
    q_rows = qo_start + row_c
    q_pos = kv_len - qo_len + row_c  # absolute position of each query in its sequence
    limit = q_pos if causal else (kv_len - 1).expand_as(q_pos)  # last key each query may see
    num_k = int(limit.max()) + 1  # causal chunks need only keys up to their last query

    pos = torch.arange(num_k, dtype=torch.int64)[None, :]  # [1, nk]
    block_idx = torch.minimum(pos // block_size, num_blocks[req, None] - 1)
    block_ids = kv_indices.to(torch.int64)[kv_indptr.to(torch.int64)[req, None] + block_idx]
    slots = block_ids * block_size + pos % block_size
    # Key padding points at the request's first slot: real, finite data, so a masked position can
    # never bring NaN/Inf from an unwritten slot into probs @ V (0 * NaN = NaN).
    slots = torch.where(pos < kv_len, slots, slots[:, :1])
    masked = pos[:, None, :] > limit[:, :, None]  # [bt, nq, nk]
    if window_left >= 0:
        masked |= pos[:, None, :] < (q_pos - window_left)[:, :, None]
    masked = masked[:, None, None]  # [bt, 1, 1, nq, nk]

    src = torch.nonzero(real_q)  # [n, 2] (request-in-tile, query row - q0)
    src_rows = src[:, 0] * (q1 - q0) + src[:, 1]
    dst_rows = q_rows[src[:, 0], src[:, 1]]
    return PagedTile(
        q_rows=q_rows.to(device),
        slots=slots.to(device),
        masked=masked.to(device),
        src_rows=src_rows.to(device),
        dst_rows=dst_rows.to(device),
    )


def build_plan(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_blocks: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    causal: bool,
    sm_scale: float,
    max_tile_elements: int,
    device: torch.device,
    window_left: int = -1,
) -> PagedPlan:
    """Tile the (already validated) batch and build every tile's device tensors (``window_left``: see
    ``build_tile``)."""
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    bounds = split_tiles(qo_lens, kv_lens.tolist(), num_qo_heads, num_kv_heads * head_dim, max_tile_elements)
    tiles = tuple(
        build_tile(t, qo_indptr, kv_indptr, kv_indices, num_blocks, kv_lens, block_size, causal, device, window_left)
        for t in bounds
    )
    return PagedPlan(
        tiles=tiles,
        num_qo_tokens=int(qo_indptr[-1]),
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        sm_scale=sm_scale,
    )
