"""RetroInfer's cluster selection by count, per decode row and KV head: every column, the ``retrieved`` best in
rank order, then the ``estimated`` ranked next and then the rest, each of those two parts in column order; the
published system takes the top ``retrieved + estimated`` and splits them, a reader with a token budget reads
in this order (past the retrieved only when they hold fewer tokens than its budget).

The rank: the softmax of each query head's logits over the row's clusters, summed over the group (a score in
``[0, G]``), truncated to 16 mantissa bits (``rank_values``), best first; empty clusters last, ties (equal
truncated scores) to the lower column. Inputs from ``cluster_logits`` (``logits`` float32 ``[n, H, G, Cw]``,
``-inf`` for an empty column, ``sizes`` ``[n, H, Cw]``, the logits' tile statistics) plus per row
``retrieved`` / ``estimated`` int ``[n]`` (a row's counts; at most ``read_width`` / ``estimate_width``, and
clamped to them and to ``Cw``). Out: int64 ``[n, H, Cw]``, a permutation of the columns: with ``k1`` and ``k2``
a row's retrieved and retrieved-plus-estimated counts, places ``[0, k1)`` hold the best ``k1`` columns best
first, places ``[k1, k2)`` the columns ranked ``k1`` to ``k2 - 1`` in ascending column order, the places after
the other columns in ascending order.

Why truncated: both paths rank by one int32 per column whose order is the rank's, ``rank_values``: the float32
score's bits shifted right by 7 (16 mantissa bits kept: a relative resolution of ``2 ** -16``), less an offset
for the group (the score is at most ``G``, so at most ``0x7F0000`` is left), plus one; 0 for an empty column.
Those values are below ``2 ** 23``, so the Triton path's radix select finds a threshold in two rounds (12 + 11
bits) where the float bits took three, a launch less per layer. Scores closer than ``2 ** -16`` relative may
tie and then go in column order.

Only the retrieved need an order (a reader cuts them at a token budget, in rank order); the estimated are a
sum. So the Triton path never sorts the row: one program per (row, KV head) writes every column's rank value,
finds the ``k1``-th and ``k2``-th largest by a radix select (``_triton/cluster_select.py``), places the columns
above each threshold and the first of the tied ones in column order (prefix sums), and sorts only the ``k1``
retrieved, in registers. The reference is a full stable sort (torch) of the same values. The scores the two
paths compute may differ in the last bits (the softmax's sums run in another order), so a score that close to
a truncation step may land on either side of it, and the columns it then ties or passes may swap.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend

RANK_DROP = 7  # low mantissa bits of the float32 score that the rank drops
RANK_BITS = 23  # rank values are below 2 ** RANK_BITS


def cluster_select(
    logits: torch.Tensor,
    sizes: torch.Tensor,
    retrieved: torch.Tensor,
    estimated: torch.Tensor,
    *,
    read_width: int,
    estimate_width: int,
    tile_max: torch.Tensor | None = None,
    tile_sum: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """int64 ``[n, H, Cw]`` as the module docstring says."""
    n, heads, group, columns = logits.shape
    if tuple(sizes.shape) != (n, heads, columns):
        raise ValueError(f"sizes must be [{n}, {heads}, {columns}], got {tuple(sizes.shape)}")
    if retrieved.shape[0] < n or estimated.shape[0] < n or read_width < 1 or estimate_width < 0:
        raise ValueError("retrieved and estimated need a count per row, read_width >= 1 and estimate_width >= 0")
    if resolve_backend(backend, logits.device) == "triton":
        from sparse_kernels._triton.cluster_select import cluster_select_triton
        from sparse_kernels.cluster_logits import softmax_statistics

        if tile_max is None or tile_sum is None:
            tile_max, tile_sum = softmax_statistics(logits)
        return cluster_select_triton(
            logits, sizes, tile_max, tile_sum, retrieved[:n], estimated[:n], read_width, estimate_width
        )
    probs = torch.softmax(logits, dim=-1).sum(2)  # a row with no live cluster: NaN, all empty below
    order = torch.sort(rank_values(probs, sizes == 0, group), dim=-1, descending=True, stable=True).indices
    return selection_layout(order, *selection_counts(retrieved[:n], estimated[:n], columns, read_width, estimate_width))


def rank_offset(group: int) -> int:
    """What ``rank_values`` subtracts from the shifted bits of a score of ``group`` heads' probabilities: the
    exponent of ``2 ** e >= group`` in the shifted bits' exponent field, so that a score up to ``group`` (the
    sum of ``group`` probabilities of at most 1, rounded) leaves at most ``0x7F0000``."""
    return (group - 1).bit_length() << (23 - RANK_DROP)


def rank_values(scores: torch.Tensor, empty: torch.Tensor, group: int) -> torch.Tensor:
    """int32 rank values of float32 ``scores`` (each a sum of ``group`` probabilities): ``(bits >> 7) -
    rank_offset(group)`` clamped to ``[0, 2 ** RANK_BITS - 2]``, plus one; 0 where ``empty`` (any score there,
    NaN too). Their order is the scores' truncated to 16 mantissa bits (the scores below ``2 ** (e - 126)`` all
    get 1; the top clamp is never reached: a score is at most ``group``)."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: no -0.0
    value = ((bits >> RANK_DROP) - rank_offset(group)).clamp_(0, (1 << RANK_BITS) - 2) + 1
    return value.masked_fill_(empty, 0)


def selection_layout(order: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """A full rank ``order`` ``[n, H, Cw]`` in the selection's layout: per row its first ``k1`` places as they
    are, the places ``[k1, k2)`` and the ones after each in ascending column order."""
    columns = order.shape[-1]
    place = torch.arange(columns, device=order.device)
    part = (place >= k1[:, None, None]).long() + (place >= k2[:, None, None]).long()  # of each ranked place
    key = torch.where(part == 0, place, part * columns + order)  # the retrieved by rank, the others by column
    return order.gather(-1, key.argsort(-1))


def selection_counts(
    retrieved: torch.Tensor, estimated: torch.Tensor, columns: int, read_width: int, estimate_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``(k1, k2)``: retrieved and retrieved-plus-estimated counts, clamped to the widths and columns."""
    k1 = retrieved.clamp(0, min(read_width, columns))
    return k1, torch.minimum(k1 + estimated.clamp(0, estimate_width), torch.full_like(k1, columns))
