"""Which slots an eviction keeps, from per-slot scores: the sink, the recent tail and the best-scored
middle, per request (``keep_indices``) or for a batch of requests that all evict (``keep_indices_batch``).

Ties go to the earlier slot everywhere. ``keep_indices_batch`` selects with one ``topk`` instead of sorting
(a decode-time round evicts a few hundred slots of thousands); ``keep_indices_batch_reference`` is the plain
two-sort version it is tested against.
"""

from __future__ import annotations

import torch


def keep_indices(scores: torch.Tensor, *, kv_len: int, sink: int, recent: int, num_middle: int) -> torch.Tensor:
    """Kept slots ``[H, n]`` (ascending per row): the first ``sink``, the last ``recent`` and the
    ``num_middle`` best-scored slots in between.

    ``scores``: ``[H, M]`` scores of slots ``0 .. M-1`` with ``M >= kv_len - recent`` (extra
    columns are ignored; with ``num_middle=0`` they are not read and may have none). When everything
    fits (``kv_len <= sink + num_middle + recent``) every slot is kept. Ties go to the earlier slot.
    """
    num_heads = scores.shape[0]
    device = scores.device
    sink = min(sink, kv_len)
    recent = min(recent, kv_len - sink)
    mid_lo, mid_hi = sink, kv_len - recent
    if mid_hi - mid_lo <= num_middle:
        return torch.arange(kv_len, device=device).expand(num_heads, kv_len).contiguous()
    if num_middle <= 0:  # sink and recent only: nothing to rank
        chosen = torch.empty(num_heads, 0, dtype=torch.long, device=device)
    else:
        middle = scores[:, mid_lo:mid_hi].float()
        # Stable top-k: sort by score descending, ties by position ascending.
        order = torch.sort(middle, dim=1, descending=True, stable=True).indices[:, :num_middle] + mid_lo
        chosen = torch.sort(order, dim=1).values
    head = torch.arange(sink, device=device).expand(num_heads, sink)
    tail = torch.arange(mid_hi, kv_len, device=device).expand(num_heads, recent)
    return torch.cat([head, chosen, tail], dim=1).contiguous()


def keep_indices_batch(
    scores: torch.Tensor, kv_lens: torch.Tensor, *, sink: int, recent: int, num_middle: int
) -> torch.Tensor:
    """``keep_indices`` of ``B`` requests that all keep ``sink + num_middle + recent`` of more slots:
    ``[B, H, sink + num_middle + recent]``.

    ``scores``: ``[B, H, M]`` with ``M >= max(kv_lens) - recent`` (columns past a request's middle are
    not read); ``kv_lens``: int64 ``[B]`` on the scores' device, each above ``sink + num_middle + recent``.
    Row ``b`` equals ``keep_indices(scores[b], kv_len=kv_lens[b], ...)`` (ties to the earlier slot).
    No sort: one ``topk`` of the fewer of the evicted and the kept middle slots (a decode round evicts a
    few hundred of thousands), then the kept ones in slot order from a prefix sum of their mask; on a GPU
    one ``top_k_ascending`` kernel does both.
    ``keep_indices_batch_reference`` is the plain two-sort version; tests hold them equal.
    """
    b, num_heads, _ = scores.shape
    device = scores.device
    mid_hi = (kv_lens - recent).view(b, 1, 1)
    parts = [torch.arange(sink, device=device).expand(b, num_heads, sink)]
    if num_middle > 0:
        middle = _middle_scores(scores, mid_hi, sink)
        top = _top_middle_device(middle, num_middle) if middle.is_cuda else _top_middle(middle, num_middle)
        parts.append(top.add_(sink))
    parts.append((mid_hi + torch.arange(recent, device=device).view(1, 1, -1)).expand(b, num_heads, recent))
    return torch.cat(parts, dim=2)


def _top_middle_device(middle: torch.Tensor, num_middle: int) -> torch.Tensor:
    """``_top_middle`` on a GPU in one selection kernel (``sparse_kernels.top_k_ascending``: the ordered bit
    patterns, ties to the earlier column, ``-0.0`` equal to ``0.0``) instead of about fifteen ops, which a
    decode-time round launches per layer. Every NaN is first made the one positive NaN whose ordered key
    ranks above every number, all NaNs equal, as ``_top_middle`` ranks them."""
    from sparse_methods._kernels import kernels

    return kernels().top_k_ascending(middle.masked_fill_(middle.isnan(), float("nan")), num_middle)


def _middle_scores(scores: torch.Tensor, mid_hi: torch.Tensor, sink: int) -> torch.Tensor:
    """``[B, H, M - sink]`` float32 scores of the slots from ``sink`` on, ``-inf`` from each request's
    ``mid_hi`` (such a slot is never kept: its row has more than ``num_middle`` slots before it, and a
    tie at ``-inf`` goes to the earlier slot)."""
    width = scores.shape[2] - sink
    outside = torch.arange(sink, sink + width, device=scores.device).view(1, 1, -1) >= mid_hi
    return scores[:, :, sink:].float().masked_fill(outside, float("-inf"))


def _top_middle(middle: torch.Tensor, num_middle: int) -> torch.Tensor:
    """Columns ``[B, H, num_middle]`` (ascending) of each row's ``num_middle`` best entries of ``middle``
    ``[B, H, W]``, in a stable descending sort's order: larger first, ties to the earlier column,
    ``-0.0`` equal to ``0.0``, NaN above everything."""
    b, h, width = middle.shape
    bits = middle.add(0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order is the floats' order
    key.masked_fill_(middle.isnan(), torch.iinfo(torch.int32).max)
    # One int64 per entry, larger ranks first: the key above, the column reversed below (earlier wins).
    cols = torch.arange(width, device=middle.device)
    rank = key.to(torch.int64).mul_(1 << 32).add_(width - 1 - cols)
    if width - num_middle <= num_middle:  # pick the evicted
        out = rank.topk(width - num_middle, dim=2, largest=False, sorted=False).indices
        kept = torch.ones_like(middle, dtype=torch.bool).scatter_(2, out, False)
    else:
        out = rank.topk(num_middle, dim=2, sorted=False).indices
        kept = torch.zeros_like(middle, dtype=torch.bool).scatter_(2, out, True)
    # Kept column j goes to place (kept before it); the others to a spare place past the end.
    place = torch.where(kept, kept.cumsum(2) - 1, num_middle)
    chosen = torch.empty(b, h, num_middle + 1, dtype=torch.int64, device=middle.device)
    return chosen.scatter_(2, place, cols.expand(b, h, width))[..., :num_middle]


def keep_indices_batch_reference(
    scores: torch.Tensor, kv_lens: torch.Tensor, *, sink: int, recent: int, num_middle: int
) -> torch.Tensor:
    """``keep_indices_batch`` by two stable sorts per row (the plain reference): the middle descending
    to take the best ``num_middle``, then those ascending."""
    b, num_heads, _ = scores.shape
    device = scores.device
    mid_hi = (kv_lens - recent).view(b, 1, 1)
    parts = [torch.arange(sink, device=device).expand(b, num_heads, sink)]
    if num_middle > 0:
        middle = _middle_scores(scores, mid_hi, sink)
        order = torch.sort(middle, dim=2, descending=True, stable=True).indices[:, :, :num_middle] + sink
        parts.append(torch.sort(order, dim=2).values)
    parts.append((mid_hi + torch.arange(recent, device=device).view(1, 1, -1)).expand(b, num_heads, recent))
    return torch.cat(parts, dim=2)
