"""Apply a method's compactions to the pool: kept slots move to the front of each layer's table.

The method decides what to keep (``sparse_methods.Compaction``); ``sparse_kernels.compact_kv``
moves the K/V rows (per KV head, since heads may keep different tokens; Triton on GPU, its
reference on CPU) and this reports each layer's new length. The caller then
shrinks the request's tables, returning whole blocks to the pool. Layers read their slots through
their own block table (the per-layer layout) or one table shared by all.

Per compacted request the host copies the inputs once (every slot list and CSR offset, packed, pinned
and non-blocking) and never waits for the device: the new lengths are the kept counts (shapes), and
the bounds check of every layer's kept indices is one reduction that asserts on the device (a CPU
raises at once). Each layer is then one ``compact_kv`` launch, so a pipelined engine compacts in
stream order while the host builds the next step.

``apply_compactions`` does the same for every request compacting at one step: one host copy for
all of them and one ``compact_kv`` launch per layer over all their slot lists (the kernel's CSR over
requests), instead of a launch per (request, layer). When a layer's keeps are rows of a batched
round's ``[B, H, n]`` tensor (``Compaction.rows``) it reads them from that tensor (a slice and one
reshape per layer, one bounds check for the step), with no tensor op per (request, layer).
``apply_compaction`` stays the reference.

A head-major store (a table per (layer, KV head) lane) compacts each lane to its own count
(``Compaction.head_counts``, host ints): ``apply_lane_compaction``, one launch per layer whose lanes
are the kernel's requests of one KV head, without waiting for the device either.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from sparse_kernels import compact_kv
from sparse_kernels.quantized_compact import compact_quantized
from sparse_methods import Compaction, KeepRows
from sparse_serve.kv_pool import KVPool
from sparse_serve.step_metadata import table_slots, to_device


def apply_compaction(
    pool: KVPool,
    block_ids: Sequence[int] | Sequence[Sequence[int]],
    kv_lens: list[int],
    compaction: Compaction,
    block_size: int,
    tail_row: int | None = None,
) -> list[int]:
    """Compact the layers named in ``compaction``; returns the new per-layer KV lengths. ``block_ids``:
    the request's table (every layer's), or per layer its table's block ids. Quantized
    stores move codes and scales (``compact_quantized``); ``tail_row``: the request's tail row where
    the store keeps one (its incomplete page is rebuilt there)."""
    if len(compaction.keep) != len(kv_lens):
        raise ValueError(f"compaction covers {len(compaction.keep)} layers, the model has {len(kv_lens)}")
    device = pool.device
    layers = _checked_layers(compaction, kv_lens, device)
    new_lens = list(kv_lens)
    if not layers:
        return new_lens
    shared = not block_ids or isinstance(block_ids[0], int)
    tables = [block_ids if shared else block_ids[layer] for layer in range(len(kv_lens))]
    sizes = [(tables[layer], kv_lens[layer], keep.shape[1]) for layer, keep in layers]
    inputs = _device_inputs(sizes, block_size, device)
    for (layer, keep), size in zip(layers, sizes, strict=True):
        slots, slot_indptr, keep_indptr = inputs[id(size[0]), size[1], size[2]]
        if pool.store.latent:  # one head: gather every kept row, then write them to the front
            flat = pool.latent[layer].view(-1, pool.store.head_dim)
            flat[slots[: keep.shape[1]].long()] = flat[slots[keep[0]].long()]
        elif pool.quantized is not None:
            tails = None if tail_row is None else torch.tensor([tail_row], dtype=torch.int32, device=device)
            compact_quantized(
                pool.quantized[layer], slots, keep, slot_indptr=slot_indptr, keep_indptr=keep_indptr, tail_index=tails
            )
        else:
            compact_kv(pool.k[layer], pool.v[layer], slots, keep, slot_indptr=slot_indptr, keep_indptr=keep_indptr)
        new_lens[layer] = keep.shape[1]
    return new_lens


def apply_compactions(
    pool: KVPool,
    requests: Sequence[tuple[Sequence[Sequence[int]], list[int], Compaction]],
    block_size: int,
    tail_rows: Sequence[int | None] | None = None,
) -> list[list[int]]:
    """``apply_compaction`` for several requests at once (``requests``: each one's per-layer tables, KV
    lengths and compaction); returns each one's new per-layer lengths (host ints: the kept counts).
    Every layer is one ``compact_kv`` launch over the requests compacting it, from one host copy of all
    slot lists and offsets (layers of equal slot lists share theirs). A layer's keeps that are
    consecutive rows of one round's tensor (``Compaction.rows``) go in as that tensor's slice, one
    reshape for them all; the bounds of every kept index are one check for the whole step. The
    requests hold distinct blocks. Latent and quantized stores go request by request (``tail_rows``: each
    request's tail row, for a store that keeps one)."""
    if len(requests) < 2 or pool.store.latent or pool.quantized is not None:
        tails = tail_rows or [None] * len(requests)
        return [
            apply_compaction(pool, tables, lens, c, block_size, tail)
            for (tables, lens, c), tail in zip(requests, tails, strict=True)
        ]
    num_layers = len(requests[0][1])
    per_layer: list[list[tuple[int, torch.Tensor, KeepRows | None]]] = [[] for _ in range(num_layers)]
    out = []
    for i, (_, kv_lens, compaction) in enumerate(requests):
        if len(compaction.keep) != len(kv_lens) or len(kv_lens) != num_layers:
            raise ValueError(f"compaction covers {len(compaction.keep)} layers, the model has {num_layers}")
        new_lens = list(kv_lens)
        for layer, keep, rows in zip(range(num_layers), compaction.keep, compaction.rows or _NO_ROWS, strict=False):
            if keep is None:
                continue
            if keep.dim() != 2 or keep.shape[1] > kv_lens[layer]:
                raise ValueError(f"layer {layer}: keeps {tuple(keep.shape)} of the layer's {kv_lens[layer]} slots")
            per_layer[layer].append((i, keep, rows))
            new_lens[layer] = keep.shape[1]
        out.append(new_lens)
    if not any(per_layer):
        return out
    launches = _packed_inputs(requests, per_layer, block_size, pool.device)
    keeps = [_layer_keep(entries, pool.device) for entries in per_layer if entries]
    _check_step_bounds(launches, keeps)
    for (layer, slots, ptrs), keep in zip(launches, keeps, strict=True):
        n = ptrs.numel() // 2
        compact_kv(pool.k[layer], pool.v[layer], slots, keep, slot_indptr=ptrs[:n], keep_indptr=ptrs[n:])
    return out


_NO_ROWS = itertools.repeat(None)


def _packed_inputs(
    requests: Sequence[tuple[Sequence[Sequence[int]], list[int], Compaction]],
    per_layer: list[list[tuple[int, torch.Tensor, KeepRows | None]]],
    block_size: int,
    device: torch.device,
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Every compacted layer's ``(layer, slot_ids, slot_indptr + keep_indptr)`` on ``device``, int32 views of
    one copy; layers with the same slot lists and kept counts share the same tensors."""
    host: list[torch.Tensor] = []
    offset = 0
    spans: dict[tuple[int, int], torch.Tensor] = {}  # (id(table), kv_len) -> its slots, one table_slots each
    shared: dict[tuple, tuple[int, int, int]] = {}  # the layer's (table, kv_len, kept) per entry -> its place
    places = []
    for layer, entries in enumerate(per_layer):
        if not entries:
            continue
        key = tuple((id(requests[i][0][layer]), requests[i][1][layer], k.shape[1]) for i, k, _ in entries)
        if key not in shared:
            slots = []
            for (table_id, kv_len, _), (i, _, _) in zip(key, entries, strict=True):
                if (table_id, kv_len) not in spans:
                    spans[table_id, kv_len] = table_slots(requests[i][0][layer], kv_len, block_size)
                slots.append(spans[table_id, kv_len])
            ptrs = [0, *itertools.accumulate(kv_len for _, kv_len, _ in key)]
            ptrs += [0, *itertools.accumulate(n for *_, n in key)]
            host += [*slots, torch.tensor(ptrs, dtype=torch.int64)]
            shared[key] = (offset, ptrs[len(entries)], len(ptrs))
            offset += ptrs[len(entries)] + len(ptrs)
        places.append((layer, shared[key]))
    packed = to_device(torch.cat(host).to(torch.int32), device)
    views = {(s, n, p): (packed[s : s + n], packed[s + n : s + n + p]) for s, n, p in shared.values()}
    return [(layer, *views[place]) for layer, place in places]


def _layer_keep(entries: list[tuple[int, torch.Tensor, KeepRows | None]], device: torch.device) -> torch.Tensor:
    """A layer's ``keep`` for ``compact_kv``: ``[num_kv_heads, total]``, the entries' columns in order. Runs of
    consecutive rows of one round's tensor are one slice of it, moved in one reshape; any other keep is
    a run of its own."""
    runs: list[tuple[torch.Tensor, int, int]] = []  # (tensor [B, H, n], first row, end row); -1: a plain keep
    for _, keep, rows in entries:
        if rows is not None and runs and runs[-1][0] is rows.batch and runs[-1][2] == rows.row:
            runs[-1] = (rows.batch, runs[-1][1], rows.row + 1)
        elif rows is not None:
            runs.append((rows.batch, rows.row, rows.row + 1))
        else:
            runs.append((keep, -1, -1))
    columns = [
        batch.to(device)
        if first < 0
        else batch[first].to(device)
        if end == first + 1
        else batch[first:end].to(device).transpose(0, 1).reshape(batch.shape[1], -1)
        for batch, first, end in runs
    ]
    return columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)


def _check_step_bounds(launches: list[tuple[int, torch.Tensor, torch.Tensor]], keeps: list[torch.Tensor]) -> None:
    """Every kept index lies in its request's slots of its layer (each column against its request's KV
    length, from the offsets: one per shared offsets): on a GPU one assert on the device for the whole
    step (no wait), elsewhere a host check that names the first layer outside."""
    limits: dict[int, torch.Tensor] = {}
    checked, oks = [], []
    for (layer, _, ptrs), keep in zip(launches, keeps, strict=True):
        if not keep.numel():
            continue
        if id(ptrs) not in limits:  # each column's limit: its request's slot count
            n = ptrs.numel() // 2
            lens, counts = ptrs[1:n] - ptrs[: n - 1], ptrs[n + 1 :] - ptrs[n:-1]
            limits[id(ptrs)] = torch.repeat_interleave(lens, counts, output_size=keep.shape[1])
        oks.append(((keep >= 0) & (keep < limits[id(ptrs)])).all())
        checked.append(layer)
    if not oks:
        return
    if oks[0].device.type == "cuda":
        torch._assert_async(torch.stack(oks).all(), "compaction: a kept index lies outside its layer's slots")
        return
    for layer, ok in zip(checked, torch.stack(oks).tolist(), strict=True):
        if not ok:
            raise ValueError(f"layer {layer}: kept index outside the layer's slots")


def _checked_layers(compaction: Compaction, kv_lens: list[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """The compacted layers' ``(layer, keep on device)``, shapes and bounds checked (``_check_bounds``)."""
    layers = [(layer, keep.to(device)) for layer, keep in enumerate(compaction.keep) if keep is not None]
    for layer, keep in layers:
        if keep.dim() != 2 or keep.shape[1] > kv_lens[layer]:
            raise ValueError(f"layer {layer}: keeps {tuple(keep.shape)} of the layer's {kv_lens[layer]} slots")
    _check_bounds(layers, kv_lens)
    return layers


def _check_bounds(layers: list[tuple[int, torch.Tensor]], kv_lens: list[int]) -> None:
    """Every kept index lies in its layer's slots: one reduction over all layers; on a GPU an assert on
    the device (no wait), elsewhere one host read that names the layer."""
    keeps = [keep for _, keep in layers if keep.numel()]
    if not keeps:
        return
    if all(k.shape == keeps[0].shape for k in keeps):  # the usual case: one budget for every layer
        lo, hi = torch.stack(keeps).flatten(1).aminmax(dim=1)
    else:
        lo, hi = (torch.stack(t) for t in zip(*(k.aminmax() for k in keeps), strict=True))
    nonempty = [layer for layer, keep in layers if keep.numel()]
    if lo.device.type == "cuda":
        lens = torch.tensor([kv_lens[layer] for layer in nonempty], device="cpu").pin_memory()
        inside = (lo >= 0).all() & (hi < lens.to(lo.device, non_blocking=True)).all()
        torch._assert_async(inside, "compaction: a kept index lies outside its layer's slots")
        return
    bounds = torch.stack([lo, hi]).tolist()
    for layer, low, high in zip(nonempty, *bounds, strict=True):
        if low < 0 or high >= kv_lens[layer]:
            raise ValueError(f"layer {layer}: kept index outside the layer's {kv_lens[layer]} slots")


def _device_inputs(
    sizes: list[tuple[Sequence[int], int, int]], block_size: int, device: torch.device
) -> dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(id(table), kv_len, num_kept) -> (slots, slot_indptr, keep_indptr)`` on ``device``, int32, from one
    copy, for each ``(table, kv_len, num_kept)`` of ``sizes``."""
    distinct = {(id(table), kv_len, n): table for table, kv_len, n in sizes}
    spans = {(key[0], key[1]): table for key, table in distinct.items()}
    host = [table_slots(table, kv_len, block_size).to(torch.int32) for (_, kv_len), table in spans.items()]
    host.append(torch.tensor([x for _, kv_len, n in distinct for x in (0, kv_len, 0, n)], dtype=torch.int32))
    packed = to_device(torch.cat(host), device)
    slots, offset = {}, 0
    for span in spans:
        slots[span] = packed[offset : offset + span[1]]
        offset += span[1]
    out = {}
    for key in distinct:
        out[key] = (slots[key[:2]], packed[offset : offset + 2], packed[offset + 2 : offset + 4])
        offset += 4
    return out


def apply_lane_compaction(
    pool: KVPool, lane_ids: Sequence[Sequence[int]], lane_lens: list[int], compaction: Compaction, block_size: int
) -> list[int]:
    """Compact a head-major request (``lane_ids`` / ``lane_lens``: per (layer, KV head) lane, layer-major);
    returns the new per-lane lengths. Layer ``l``'s head ``h`` keeps the first ``counts(l)[h]`` entries
    of its ``keep`` row (picked on the device by host-made positions: no wait)."""
    num_layers = len(compaction.keep)
    heads = len(lane_lens) // num_layers
    if heads * num_layers != len(lane_lens):
        raise ValueError(f"{len(lane_lens)} lanes are not {num_layers} layers' KV heads")
    new_lens, device = list(lane_lens), pool.device
    for layer, keep in enumerate(compaction.keep):
        if keep is None:
            continue
        counts, lanes, width = compaction.counts(layer), range(layer * heads, (layer + 1) * heads), keep.shape[1]
        if len(counts) != heads or any(n > width or n > lane_lens[t] for n, t in zip(counts, lanes, strict=True)):
            raise ValueError(f"layer {layer}: keeps {counts} of rows {tuple(keep.shape)} over {heads} lanes")
        pick = [h * width + i for h, n in enumerate(counts) for i in range(n)]  # row h's first counts[h]
        limit = [lane_lens[t] for t, n in zip(lanes, counts, strict=True) for _ in range(n)]
        slots = torch.cat([table_slots(lane_ids[t], lane_lens[t], block_size) for t in lanes])
        offsets = [0, *itertools.accumulate(lane_lens[t] for t in lanes), 0, *itertools.accumulate(counts)]
        host = torch.cat([slots, torch.tensor(offsets + pick + limit, dtype=torch.int64)]).to(torch.int32)
        packed, k = to_device(host, device), len(pick)
        n_slots = slots.numel()
        indptr = packed[n_slots : n_slots + 2 * (heads + 1)]
        kept = keep.to(device).flatten()[packed[-2 * k : -k].long()] if k else keep.new_zeros(0)
        _check_lane_bounds(kept, packed[-k:] if k else packed[:0], layer)
        compact_kv(
            pool.k[layer],
            pool.v[layer],
            packed[:n_slots],
            kept.view(1, -1),
            slot_indptr=indptr[: heads + 1],
            keep_indptr=indptr[heads + 1 :],
        )
        for lane, n in zip(lanes, counts, strict=True):
            new_lens[lane] = n
    return new_lens


def _check_lane_bounds(kept: torch.Tensor, limit: torch.Tensor, layer: int) -> None:
    """``0 <= kept < limit`` (each kept index within its lane): asserted on a GPU, checked at once elsewhere."""
    if not kept.numel():
        return
    inside = ((kept >= 0) & (kept < limit)).all()
    if kept.device.type == "cuda":
        torch._assert_async(inside, "compaction: a kept index lies outside its lane's slots")
    elif not bool(inside):
        raise ValueError(f"layer {layer}: kept index outside its lane's slots")
