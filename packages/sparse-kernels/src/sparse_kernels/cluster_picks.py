"""RetroInfer's decode picks from a ranking of cluster columns: the slots a row reads exactly and the clusters
it estimates, per decode row and KV head.

Inputs, for ``n`` rows and ``H`` KV heads: ``order`` int64 ``[n, H, top]`` cluster columns in the order they
are read (from the row's first column; ``cluster_select``'s: the retrieved best first, then the estimated);
``sizes`` int ``[n, H, Cw]`` each column's size (0: empty, or past the row's index); the arena's
``offsets`` ``[H, C]`` (a cluster's first entry in ``positions``) and ``positions`` ``[H, P]`` (token positions
grouped by cluster); ``plan`` int64 ``[7, n]`` per row (token base, cluster base, clusters, index end,
cluster-token budget, clusters retrieved, clusters estimated) and ``kv_lens`` ``[n]``.

With ``ranked`` the ordered columns' sizes and ``cum`` their running sums:

- ``slots`` int64 ``[n, H, width]``: the first ``min(sink, kv)`` positions; then the first
  ``picked = clamp(min(budget, cum[-1]), 0, reach)`` tokens of the ranked clusters (the ``j``-th in the
  cluster whose running size first passes ``j``, at ``positions[tok_base + offset + j - (cum - ranked)]``);
  then the unindexed tail ``[max(end, min(sink, kv)), kv)``; past those the newest position ``kv - 1``.
- ``ids`` int64 ``[n, H, estimate_width]`` (None when ``estimate_width`` is 0): with ``read`` the places the
  row's reads reach (wholly or in part: running start below the budget; empty clusters too), the columns ordered
  from ``read`` up to ``min(retrieved + estimated, clusters)``, as arena columns (plus the cluster base);
  ``-1`` past them.

The reference is plain torch (a searchsorted over ``cum`` for the picked tokens); the Triton path runs one kernel
by default (``_triton.cluster_picks.ONE_LAUNCH``; 0.44 ms a step against the pair's 0.55 on the H200 at batch 5 /
128K): one program per (row, KV head, tile of slots) that computes its row's ``cum`` and read count itself, writes
its share of the estimated ids and finds the cluster of each of its picked tokens by a binary search over ``cum``;
or two: one program per (row, KV head) for the running sums, the read count and the estimated ids, then one per
(row, KV head, tile of slots) searching the ``cum`` it wrote.
"""

from __future__ import annotations

import torch

from sparse_kernels._backend import resolve_backend


def cluster_picks(
    order: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor,
    plan: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    sink: int,
    width: int,
    reach: int,
    estimate_width: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(slots, ids)`` as the module docstring says; ``reach`` (at least 1) bounds the picked tokens."""
    n, heads, top = order.shape
    if sizes.shape[:2] != (n, heads) or offsets.shape[0] != heads or positions.shape[0] != heads:
        raise ValueError(f"sizes must be [{n}, {heads}, Cw] and offsets / positions have {heads} heads")
    if plan.shape[0] != 7 or plan.shape[1] < n or kv_lens.shape[0] < n or min(top, reach, width) < 1:
        raise ValueError("plan must be [7, >= n], kv_lens cover every row, and top, reach, width be positive")
    if resolve_backend(backend, order.device) == "triton":
        from sparse_kernels._triton.cluster_picks import cluster_picks_triton

        return cluster_picks_triton(
            order, sizes, offsets, positions, plan, kv_lens, sink=sink, width=width, reach=reach, est=estimate_width
        )
    ranked = sizes.gather(-1, order)  # the ordered clusters' sizes and their running sums, shared by both parts
    cum = ranked.cumsum(-1)
    plan = plan[:, :n]
    slots = _slots(order, ranked, cum, offsets, positions, plan, kv_lens[:n], sink, width, reach)
    return slots, (_estimated(order, ranked, cum, plan, estimate_width) if estimate_width > 0 else None)


def _slots(order, ranked, cum, offsets_all, positions, plan, kv, sink: int, width: int, reach: int) -> torch.Tensor:
    n, heads, top = order.shape
    device = order.device
    tok_base, clu_base, _, end, budget, _, _ = plan
    head = torch.arange(heads, device=device)[None, :, None]
    first = offsets_all[head, (clu_base[:, None, None] + order).clamp_(max=offsets_all.shape[1] - 1)]  # [n, H, k]
    j = torch.arange(reach, device=device).expand(n, heads, reach).contiguous()
    rank = torch.searchsorted(cum, j, right=True).clamp_(max=top - 1)
    within = j - (cum - ranked).gather(-1, rank)
    slot = (tok_base[:, None, None] + first.gather(-1, rank) + within).clamp_(0, positions.shape[1] - 1)
    num_picked = torch.minimum(budget[:, None, None], cum[..., -1:]).clamp_(0, reach)
    picked = positions[head, slot]
    num_sink = kv.clamp(0, sink)[:, None, None]  # [n, 1, 1]
    tail_lo = torch.maximum(end[:, None, None], num_sink)
    num_tail = (kv[:, None, None] - tail_lo).clamp_(min=0)
    i = torch.arange(width, device=device)
    k = i - num_sink  # [n, 1, W] place among the cluster tokens, then (less num_picked) in the tail
    from_clusters = picked.gather(-1, k.clamp(0, reach - 1).expand(n, heads, width)).long()
    newest = (kv - 1).clamp(min=0)[:, None, None]
    out = torch.where(k - num_picked < num_tail, tail_lo + k - num_picked, newest)
    out = torch.where(k < num_picked, from_clusters, out)
    return torch.where(k < 0, i, out)


def _estimated(order, ranked, cum, plan, width: int) -> torch.Tensor:
    top = order.shape[-1]
    _, clu_base, count, _, budget, retrieved, estimated = plan
    read = ((cum - ranked) < budget[:, None, None]).sum(-1)  # [n, H] places read (empty ones too)
    k = torch.arange(width, device=order.device)
    rank = read[..., None] + k  # [n, H, E]
    wanted = torch.minimum(retrieved + estimated, count)[:, None] - read  # [n, H]
    ids = clu_base[:, None, None] + order.gather(-1, rank.clamp(max=top - 1))
    return torch.where((k < wanted[..., None]) & (rank < top), ids, -1)
