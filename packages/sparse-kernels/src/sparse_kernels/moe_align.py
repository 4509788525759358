"""Group a mixture-of-experts step's (token, expert) pairs by expert, in tiles of ``block_m`` rows.

A step routes each of its ``T`` tokens to ``k`` experts: ``T * k`` *entries*, entry ``i`` being token
``i // k``'s ``i % k``-th choice (``topk_ids.reshape(-1)``). A grouped GEMM wants the entries of one
expert in consecutive rows, and every tile of ``block_m`` rows owned by a single expert, so each
expert's run is padded up to a multiple of ``block_m``. The result has a fixed size that depends only
on ``T * k``, ``E`` and ``block_m`` (not on the routing), so the step needs no host sync and replays
under a CUDA graph (one Triton launch, ``sparse_kernels._triton.moe_align``):
tiles past the last expert's are marked with expert id ``E`` and their programs exit at once, and
the tile count bound is small at decode (``T * k`` entries need at most ``T * k`` tiles however they
are spread), so a decode step only ever reads the chosen experts' weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_kernels._backend import resolve_backend


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """The entries of a step sorted by expert and cut into single-expert tiles.

    ``sorted_ids`` int32 ``[num_tiles * block_m]``: entry ids, grouped by expert (ascending) and in
    entry order within an expert; each expert's run starts on a tile boundary, and its padding rows
    hold ``num_entries`` (one past the last entry). ``tile_experts`` int32 ``[num_tiles]``: the expert
    of each tile, ``num_experts`` for tiles past the last expert's run.
    """

    sorted_ids: torch.Tensor
    tile_experts: torch.Tensor
    num_entries: int
    num_experts: int
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.tile_experts.numel()


def max_expert_tiles(num_entries: int, num_experts: int, block_m: int) -> int:
    """Tiles enough for any routing of ``num_entries`` entries over ``num_experts`` experts.

    Expert ``e`` with ``n_e > 0`` entries takes ``ceil(n_e / block_m) <= (n_e + block_m - 1) / block_m``
    tiles, and at most ``min(E, num_entries)`` experts are non-empty, so the sum is at most
    ``(num_entries + min(E, num_entries) * (block_m - 1)) / block_m``.
    """
    return (num_entries + min(num_experts, num_entries) * (block_m - 1)) // block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, backend: str = "auto") -> ExpertTiles:
    """Sort the entries of ``topk_ids [T, k]`` (ids in ``[0, num_experts)``) by expert into tiles.

    Graph-safe (no host sync, routing-independent shapes); ids outside ``[0, num_experts)`` are not
    checked and corrupt the result. ``backend``: as everywhere (``sparse_kernels._backend``); Triton
    aligns in one launch, the reference runs device-side torch ops (some twenty launches). Both give
    the same tiles, entries in ascending order within an expert.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {list(topk_ids.shape)}")
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m and num_experts must be positive, got {block_m} and {num_experts}")
    num_entries = topk_ids.numel()
    num_tiles = max_expert_tiles(num_entries, num_experts, block_m)
    if num_entries and resolve_backend(backend, topk_ids.device) == "triton":
        from sparse_kernels._triton.moe_align import align_by_expert_triton

        flat = topk_ids.reshape(-1)
        sorted_ids, tile_experts = align_by_expert_triton(flat, num_experts, block_m, num_tiles)
        return ExpertTiles(sorted_ids, tile_experts, num_entries, num_experts, block_m)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [N] expert of each entry
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E] inclusive: expert e's run is [padded_end[e] - padded[e], padded_end[e])
    order = torch.argsort(flat, stable=True)  # entries grouped by expert, in entry order within one
    experts = flat[order]
    rank = torch.arange(num_entries, device=device) - (counts.cumsum(0) - counts)[experts]  # index within its expert
    dest = (padded_end - padded)[experts] + rank
    sorted_ids = torch.full((num_tiles * block_m,), num_entries, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(num_tiles, device=device) * block_m
    # The first expert whose run ends after the tile's start; empty experts (end == start) are passed over.
    tile_experts = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return ExpertTiles(sorted_ids, tile_experts, num_entries, num_experts, block_m)
