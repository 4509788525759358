"""RetroInfer's cluster ranking order: per decode row and KV head, the columns of the row's clusters best
first, by the softmax of each query head's logits over the row's clusters summed over the group (empty
clusters last), ties to the lower column; the first ``top`` of them.

``logits`` float32 ``[n, H, G, Cw]`` (``-inf`` for an empty column) and ``sizes`` ``[n, H, Cw]`` come from
``cluster_logits``, with its tiles' softmax statistics ``tile_max`` / ``tile_sum`` ``[n, H, G, T]``. The
reference is torch: a softmax, a sum over the group and one stable descending sort. The Triton path merges
the tiles' statistics instead of reading the logits twice and sorts in two kernels: one program per (row,
KV head, chunk of columns) scores its chunk and sorts it in registers (``tl.sort``) as unique int64 keys
(the score's bits, descending, above the column), then one per (row, KV head, chunk, slice of the chunk)
places each key at its rank, its place in its own chunk plus the keys below it in every other chunk (a
binary search in each, all chunks at once); a row that fits one chunk is written directly. On the H200 a
segmented ``torch.sort`` of 40 rows x 8320 columns took 57 us per layer under CUDA graphs (six radix
passes, ``results/bench/h200/session12``).

The scores the two paths compute can differ in the last bits (the softmax's sums run in another order), so
columns whose scores are that close may swap; everything else is the reference's order.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def cluster_order(
    logits: torch.Tensor,
    sizes: torch.Tensor,
    top: int,
    *,
    tile_max: torch.Tensor | None = None,
    tile_sum: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """int64 ``[n, H, top]`` columns (``1 <= top <= Cw``), best first."""
    n, heads, group, columns = logits.shape
    if tuple(sizes.shape) != (n, heads, columns) or not 1 <= top <= columns:
        raise ValueError(f"sizes must be [{n}, {heads}, {columns}] and top in [1, {columns}], got {top}")
    if resolve_backend(backend, logits.device) == "triton":
        from sparse_kernels._triton.cluster_order import cluster_order_triton
        from sparse_kernels.cluster_logits import softmax_statistics

        if tile_max is None or tile_sum is None:
            tile_max, tile_sum = softmax_statistics(logits)
        return cluster_order_triton(logits, sizes, tile_max, tile_sum, top)
    empty = sizes == 0
    probs = torch.softmax(logits, dim=-1).sum(2)  # a row with no live cluster: NaN, then -inf below
    scores = probs.nan_to_num(nan=0.0).masked_fill(empty, float("-inf"))
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top]
