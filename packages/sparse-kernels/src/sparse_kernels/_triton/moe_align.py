"""Triton ``align_by_expert`` for small steps: one program, one launch (the torch ops of the reference
are some twenty launches, which at decode would cost more than the expert GEMMs).

The program holds every entry: a histogram gives each expert's count, cumulative sums its run in the
sorted order and its padded run in the output, and a sort of ``expert * BLOCK_N + entry`` lists the
entries grouped by expert in entry order. Each output position then finds its expert (the number of
padded runs that end at or before it), its offset in that run, and gathers its entry, or the padding
value ``num_entries``: every position is written once, so no fill and no barrier are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

BLOCK_Q = 64  # output positions per loop step


def _moe_align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    tile_experts_ptr,
    num_entries,
    num_positions,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < num_entries
    experts = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    counts = tl.histogram(experts, BLOCK_E, mask=mask)  # [BLOCK_E]; bins past NUM_EXPERTS stay 0
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = tl.cumsum(counts, 0) - counts  # each expert's first index in the grouped order
    key = tl.where(mask, experts * BLOCK_N + offs, BLOCK_E * BLOCK_N)  # absent entries sort last
    grouped = tl.sort(key) % BLOCK_N  # entry ids grouped by expert, in entry order within one
    for q0 in range(0, num_positions, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        expert = tl.sum((padded_end[None, :] <= q[:, None]).to(tl.int32), 1)  # runs ending at or before q
        expert = tl.minimum(expert, NUM_EXPERTS)  # past the last run: the grid-padding id
        owned = expert < NUM_EXPERTS
        e = tl.where(owned, expert, 0)
        offset = q - tl.gather(padded_start, e, 0)
        real = owned & (offset < tl.gather(counts, e, 0))
        entry = tl.gather(grouped, tl.where(real, tl.gather(start, e, 0) + offset, 0), 0)
        in_range = q < num_positions
        tl.store(sorted_ids_ptr + q, tl.where(real, entry, num_entries), mask=in_range)
        tl.store(tile_experts_ptr + q // BLOCK_M, expert, mask=in_range & (q % BLOCK_M == 0))
    pdl_exit(USE_GDC)


moe_align_kernel = Kernel(_moe_align_kernel)


def align_by_expert_triton(
    flat_ids: torch.Tensor, num_experts: int, block_m: int, num_tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, tile_experts)`` of ``flat_ids [N]`` (checked by ``sparse_kernels.moe_align``)."""
    num_entries = flat_ids.numel()
    sorted_ids = torch.empty(num_tiles * block_m, dtype=torch.int32, device=flat_ids.device)
    tile_experts = torch.empty(num_tiles, dtype=torch.int32, device=flat_ids.device)
    block_n = max(16, triton.next_power_of_2(num_entries))
    moe_align_kernel[(1,)](
        flat_ids,
        sorted_ids,
        tile_experts,
        num_entries,
        num_tiles * block_m,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        BLOCK_Q=BLOCK_Q,
        num_warps=4 if block_n <= 512 else 8,
        **pdl_args(flat_ids.device),
    )
    return sorted_ids, tile_experts
