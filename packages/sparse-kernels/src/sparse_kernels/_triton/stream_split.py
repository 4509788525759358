"""How a streaming kernel over every row's pages (or tokens) cuts its fixed grid.

``page_bounds`` and ``paged_logits`` read each row's whole table once, like a dense decode: they only
reach the device's bandwidth with enough programs in flight (several per SM) and enough work per
program to amortize its preamble (the table entries and the queries) and to keep a pipelined loop
busy. The grid depends only on static sizes (rows, heads, ``max_pages``), so it is graph-safe.
"""

from __future__ import annotations

import triton

TARGET_PROGRAMS = 2048  # ~16 programs per SM of an H100/H200 (132 SMs): enough loads in flight


def items_per_program(rows: int, width: int, block: int, *, min_blocks: int = 1, max_blocks: int = 16) -> int:
    """Items (pages or tokens) each program covers, a multiple of ``block``: ``rows * width`` spread
    over about ``TARGET_PROGRAMS`` programs, between ``min_blocks`` and ``max_blocks`` loop steps."""
    per_program = triton.cdiv(rows * width, TARGET_PROGRAMS)
    blocks = min(max(triton.cdiv(per_program, block), min_blocks), max_blocks, triton.cdiv(width, block))
    return max(blocks, 1) * block
