"""Reference decode over per-(request, KV head) lists, with optional per-slot attention scores.

Serves head-sparse plans and ``scores_out`` on the reference backend (dense plans without scores keep
the shared prefill planner). A dense plan is expanded to one list per (request, KV head) with the same
pages. Lists are grouped longest first into tiles padded to a common length; ``run`` is a few batched
gathers and matmuls per tile, with no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_kernels._decode_layout import DecodeLayout


@dataclass(frozen=True, slots=True)
class ListTile:
    """Device tensors of ``nl`` lists padded to ``nk`` tokens."""

    req: torch.Tensor  # int64 [nl]: request (row of q)
    head: torch.Tensor  # int64 [nl]: KV head
    slots: torch.Tensor  # int64 [nl, nk]: pool slot of each token (padding -> the list's first slot)
    valid: torch.Tensor  # bool [nl, nk]
    cols: torch.Tensor  # int64 [nl, nk]: scores_out column (padding -> the list's first column, adds 0)


def build_list_plan(
    layout: DecodeLayout,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_len: torch.Tensor,
    max_tile_elements: int,
    device: torch.device,
) -> tuple[ListTile, ...]:
    """Tile the (validated, host) CSR into ``ListTile``s whose float32 working set fits the cap."""
    indptr = kv_indptr.to(torch.int64)
    num_pages = indptr[1:] - indptr[:-1]
    lens = (num_pages - 1) * layout.page_size + kv_last_len.to(torch.int64)
    hkv = layout.num_kv_heads
    lists = torch.arange(layout.num_lists)
    if layout.head_sparse:
        req, head, src = lists // hkv, lists % hkv, lists
    else:  # every KV head of request b reads request b's list
        src = lists.repeat_interleave(hkv)
        req, head = src, torch.arange(hkv).repeat(layout.num_lists)
    row_cost = 2 * layout.head_dim + 2 * layout.group  # gathered K and V, scores and probs
    order = sorted(range(src.numel()), key=lambda i: int(lens[src[i]]), reverse=True)
    tiles, i = [], 0
    while i < len(order):
        nk = int(lens[src[order[i]]])
        j = i + 1
        while j < len(order) and (j - i + 1) * nk * row_cost <= max_tile_elements and 2 * lens[src[order[j]]] >= nk:
            j += 1
        pick = torch.tensor(order[i:j])
        tiles.append(_tile(req[pick], head[pick], src[pick], nk, indptr, kv_indices, lens, layout, device))
        i = j
    return tuple(tiles)


def _tile(req, head, src, nk, indptr, kv_indices, lens, layout: DecodeLayout, device) -> ListTile:
    page = layout.page_size
    pos = torch.arange(nk)[None, :]  # [1, nk]
    start = indptr[src][:, None]  # [nl, 1]
    page_idx = torch.minimum(pos // page, indptr[src + 1][:, None] - start - 1)
    slots = kv_indices.to(torch.int64)[start + page_idx] * page + pos % page
    valid = pos < lens[src][:, None]
    if layout.window_left >= 0:  # the query sits at the list's last token
        valid &= pos >= lens[src][:, None] - 1 - layout.window_left
    slots = torch.where(valid, slots, slots[:, :1])
    cols = torch.where(valid, start * page + pos, start * page)
    return ListTile(
        req=req.to(device),
        head=head.to(device),
        slots=slots.to(device),
        valid=valid.to(device),
        cols=cols.to(device),
    )


def run_list_decode(
    layout: DecodeLayout,
    tiles: tuple[ListTile, ...],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scores_out: torch.Tensor | None,
    lse_out: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fill ``out`` ``[B, Hq, D]`` (and ``scores_out``, zeroed first; ``lse_out`` ``[B, Hq]``, each query
    head's natural-log softmax denominator; ``logits_out`` ``[B, Hq, W]`` of a dense plan, each listed token's
    raw logit at its position, columns past the list untouched) from the tiles; inputs are checked."""
    hkv, group, dim = layout.num_kv_heads, layout.group, layout.head_dim
    k_flat = k_cache.view(-1, hkv, dim)
    v_flat = v_cache.view(-1, hkv, dim)
    q4 = q.view(layout.batch, hkv, group, dim)
    o4 = out.view(layout.batch, hkv, group, dim)
    if scores_out is not None:
        scores_out.zero_()
    for t in tiles:
        qt = q4[t.req, t.head].float() * layout.sm_scale  # [nl, g, D]
        kt = k_flat[t.slots, t.head[:, None]].float()  # [nl, nk, D]
        vt = v_flat[t.slots, t.head[:, None]].float()
        scores = qt @ kt.transpose(1, 2)  # [nl, g, nk]
        scores.masked_fill_(~t.valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o4[t.req, t.head] = (probs @ vt).to(out.dtype)
        if lse_out is not None:
            lse_out.view(layout.batch, hkv, group)[t.req, t.head] = torch.logsumexp(scores, dim=-1)
        if logits_out is not None:  # dense lists: token j of request b's list sits at column j
            nk = scores.shape[-1]
            rows = logits_out.view(layout.batch, hkv, group, -1)[t.req, t.head, :, :nk]  # a copy
            rows = torch.where(t.valid[:, None, :], scores, rows)
            logits_out.view(layout.batch, hkv, group, -1)[t.req, t.head, :, :nk] = rows
        if scores_out is not None:
            summed = probs.sum(1) * t.valid  # padding columns receive exactly 0
            index = (t.cols,) if layout.head_sparse else (t.head[:, None].expand_as(t.cols), t.cols)
            scores_out.index_put_(index, summed, accumulate=True)
    return out
