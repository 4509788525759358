"""Triton ``align_by_expert``: one launch, one program per expert plus one for the grid padding.

Every program counts the step's entries per expert (a histogram over all ``T * k`` ids, in chunks, from
L2), so each knows where every padded run starts without talking to the others. Program ``e`` then
writes its own run: its entries in entry order (a running cumulative sum of ``id == e`` gives each its
rank), the padding rows after them, and the expert id of its tiles. The last program marks the tiles
past the last run (expert id ``E``, rows ``num_entries``). Every output position is written exactly
once, so no fill, no barrier and no sort.

The one-program kernel this replaces sorted all entries in one program: 57 us at 512 entries on an
H200 (``results/bench/h200/prefill/kernels/moe_probe.json``, ``align_ms`` at T = 64), a tenth of the
layer; spread over 129 programs the counting and scattering is a few microseconds at any decode size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_kernels._triton.launch import Kernel, pdl_args, pdl_enter, pdl_exit

CHUNK = 1024  # entries per counting / scattering step
BLOCK_T = 16  # tiles (or padding rows) written per step


def _moe_align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    tile_experts_ptr,
    num_entries,
    num_tiles,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    expert = tl.program_id(0)  # NUM_EXPERTS: the grid padding's program
    pdl_enter(USE_GDC)  # the ids are this step's router's
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_entries, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        mask = offs < num_entries
        ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=mask)  # bins past NUM_EXPERTS stay 0
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    if expert < NUM_EXPERTS:
        this = tl.arange(0, BLOCK_E) == expert
        run_end = tl.sum(tl.where(this, padded_end, 0))
        run_start = run_end - tl.sum(tl.where(this, padded, 0))
        count = tl.sum(tl.where(this, counts, 0))
        rank = tl.full([], 0, tl.int32)  # entries of this expert seen so far
        for c0 in range(0, num_entries, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_entries, other=NUM_EXPERTS).to(tl.int32)
            mine = ids == expert
            dest = run_start + rank + tl.cumsum(mine.to(tl.int32), 0) - 1
            tl.store(sorted_ids_ptr + dest, offs, mask=mine)
            rank += tl.sum(mine.to(tl.int32))
        pad = run_start + count + tl.arange(0, BLOCK_M)  # the run's padding rows: fewer than BLOCK_M
        tl.store(sorted_ids_ptr + pad, num_entries, mask=pad < run_end)
        for t0 in range(run_start // BLOCK_M, run_end // BLOCK_M, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tl.store(tile_experts_ptr + t, expert, mask=t < run_end // BLOCK_M)
    else:
        first = tl.sum(padded) // BLOCK_M  # the first tile past every run
        for t0 in range(first, num_tiles, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tl.store(tile_experts_ptr + t, NUM_EXPERTS, mask=t < num_tiles)
            rows = t[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            tl.store(sorted_ids_ptr + rows, num_entries, mask=(t < num_tiles)[:, None])
    pdl_exit(USE_GDC)


moe_align_kernel = Kernel(_moe_align_kernel)


def align_by_expert_triton(
    flat_ids: torch.Tensor, num_experts: int, block_m: int, num_tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, tile_experts)`` of ``flat_ids [N]``, ``N > 0`` (checked by ``sparse_kernels.moe_align``)."""
    num_entries = flat_ids.numel()
    sorted_ids = torch.empty(num_tiles * block_m, dtype=torch.int32, device=flat_ids.device)
    tile_experts = torch.empty(num_tiles, dtype=torch.int32, device=flat_ids.device)
    moe_align_kernel[(num_experts + 1,)](
        flat_ids,
        sorted_ids,
        tile_experts,
        num_entries,
        num_tiles,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        CHUNK=min(CHUNK, max(16, triton.next_power_of_2(num_entries))),
        BLOCK_T=BLOCK_T,
        num_warps=4,
        **pdl_args(flat_ids.device),
    )
    return sorted_ids, tile_experts
