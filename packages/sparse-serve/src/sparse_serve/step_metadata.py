"""Host-side metadata of one step, built once and copied to the device once.

Tokens of all scheduled requests are laid out flat: single-token items (decodes) first, then
prefill chunks. Paged attention metadata uses FlashInfer's CSR names, all int32.

Positions are logical (RoPE), while the slots a token's KV goes to follow the request's KV length
in each layer, which eviction can make shorter than the position and different per layer. Layers
whose KV lengths agree for every request of the step form one *layer group* sharing one slot
mapping and one pair of kernel plans; without per-layer eviction there is exactly one group. In the
per-layer layout (``sparse_cache.LayerLayout``) each layer also has its own block table, so layers group
only with layers of the same table: every layer is its own group. In the head-major layout each
(layer, KV head) lane has its own table and length: a layer's group lists one row per (item, head)
(``heads``), see ``head_major_group``.
"""

from __future__ import annotations

import functools
import itertools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparse_cache import BlockTable, LayerLayout
from sparse_methods import RequestStep
from sparse_serve.request import Request
from sparse_serve.scheduler import ScheduledBatch


@dataclass(frozen=True, slots=True)
class LayerGroupMetadata:
    """Where one group of layers stores the step's K/V and which slots its attention reads.

    slot_mapping : [num_tokens] int32.
    block_ids : per scheduled item, the block ids of the group's table (``array('i')``; read only).
    decode_kv_* : CSR over the blocks of the single-token items (kv_indptr [Bd+1], kv_indices, kv_last_len [Bd]).
    prefill_* : qo_indptr [Bp+1] (relative to the first prefill token) and CSR over their blocks.
    heads : 1, or the KV heads of a head-major group: then ``kv_lens``, ``block_ids`` and the CSR rows are
        per (item, head) lane (row ``item * heads + head``), the slot mapping ``[num_tokens * heads]`` is
        token-major (entry ``t * heads + h``), and ``prefill_rows`` int64 ``[num_prefill_tokens * heads]``
        lists, in lane order (item, head, token), each prefill query's row of the token-major
        ``[num_prefill_tokens * heads, group, head_dim]`` view of the prefill queries.
    """

    layers: tuple[int, ...]
    kv_lens: tuple[int, ...]  # per scheduled item, before the step
    block_ids: tuple[array, ...]
    slot_mapping: torch.Tensor
    decode_kv_indptr: torch.Tensor
    decode_kv_indices: torch.Tensor
    decode_kv_last_len: torch.Tensor
    prefill_qo_indptr: torch.Tensor
    prefill_kv_indptr: torch.Tensor
    prefill_kv_indices: torch.Tensor
    prefill_kv_last_len: torch.Tensor
    heads: int = 1
    prefill_rows: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Tensors describing one forward step (CPU tensors; the runner copies what the device needs).

    input_ids, positions : [num_tokens] int64.
    num_decode_tokens : the leading tokens that are single-token items (one per request).
    groups / layer_group : the layer groups, and each layer's group index.
    steps / row_starts : per scheduled item, its ``RequestStep`` and first flat row.
    logits_indices : [num_sampled] int64, the flat rows whose logits are sampled.
    sampled : the requests sampled this step, in ``logits_indices`` order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    num_decode_tokens: int
    num_prefill_requests: int
    groups: tuple[LayerGroupMetadata, ...]
    layer_group: tuple[int, ...]
    steps: tuple[RequestStep, ...]
    row_starts: tuple[int, ...]
    logits_indices: torch.Tensor
    sampled: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_decode_requests(self) -> int:
        return self.num_decode_tokens

    @property
    def slot_mapping(self) -> torch.Tensor:
        """The slot mapping of layer 0's group (all layers', without per-layer eviction)."""
        return self.groups[self.layer_group[0]].slot_mapping


def _i32(x) -> torch.Tensor:
    """int32 tensor of a list (converted in C by ``array``, several times faster than torch.tensor for
    long lists), of an ``array('i')`` or of a numpy array (shared, not copied: the caller never changes
    it again)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32))
    if not isinstance(x, array):
        x = array("i", x)
    return torch.frombuffer(x, dtype=torch.int32) if x else torch.zeros(0, dtype=torch.int32)


def _csr(
    block_ids: list[array], kv_lens: list[int], block_size: int, skips: list[int]
) -> tuple[list[int], array, list[int]]:
    """CSR over each list's block ids ``skip .. ceil(kv_len / block_size)``: one memory copy per request."""
    indptr, indices, last_len = [0], array("i"), []
    for ids, kv_len, skip in zip(block_ids, kv_lens, skips, strict=True):
        num_blocks = -(-kv_len // block_size)
        indices += ids[skip:num_blocks]
        indptr.append(len(indices))
        last_len.append(kv_len - (num_blocks - 1) * block_size)
    return indptr, indices, last_len


def _slots(ids: array, start: int, end: int, block_size: int) -> list[int]:
    """Pool slots of positions ``[start, end)`` of a table with block ids ``ids``."""
    if start < 0 or end > len(ids) * block_size:
        raise IndexError(f"positions [{start}, {end}) outside the table's {len(ids) * block_size} slots")
    return [ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _group(
    layers: tuple[int, ...],
    kv_lens: tuple[int, ...],
    items,
    block_ids: list[array],
    num_decode: int,
    block_size: int,
    first_read: Callable[[int], int] | None = None,
) -> LayerGroupMetadata:
    # A windowed layer's lists start at the first block its first query reads (``first_read(kv_len)``):
    # the blocks before it were given back (the null block stands in their table). The kernels place
    # queries and windows relative to the list's end, so whole blocks left off the front change nothing.
    skips = [0] * len(kv_lens) if first_read is None else [first_read(kv_len) for kv_len in kv_lens]
    slots: list[int] = []
    ends: list[int] = []
    for (_, n), ids, kv_len in zip(items, block_ids, kv_lens, strict=True):
        if n == 1 and kv_len < len(ids) * block_size:  # a decode: its one slot, without building a range
            slots.append(ids[kv_len // block_size] * block_size + kv_len % block_size)
        else:
            slots += _slots(ids, kv_len, kv_len + n, block_size)
        ends.append(kv_len + n)
    qo_indptr = [0]
    for _, n in items[num_decode:]:
        qo_indptr.append(qo_indptr[-1] + n)
    return _lists(layers, kv_lens, block_ids, slots, ends, skips, num_decode, qo_indptr, block_size)


def _lists(layers, kv_lens, block_ids, slots, ends, skips, num_decode_rows, qo_indptr, block_size, **extra):
    """A group's metadata from its rows (``block_ids``, their ``ends`` after the step and ``skips``, the
    first ``num_decode_rows`` single-token ones), its slot mapping and the prefill rows' ``qo_indptr``."""
    d = num_decode_rows
    d_indptr, d_indices, d_last = _csr(block_ids[:d], ends[:d], block_size, skips[:d])
    p_indptr, p_indices, p_last = _csr(block_ids[d:], ends[d:], block_size, skips[d:])
    return LayerGroupMetadata(
        layers=layers,
        kv_lens=tuple(kv_lens),
        block_ids=tuple(block_ids),
        slot_mapping=_i32(slots),
        decode_kv_indptr=_i32(d_indptr),
        decode_kv_indices=_i32(d_indices),
        decode_kv_last_len=_i32(d_last),
        prefill_qo_indptr=_i32(qo_indptr),
        prefill_kv_indptr=_i32(p_indptr),
        prefill_kv_indices=_i32(p_indices),
        prefill_kv_last_len=_i32(p_last),
        **extra,
    )


def head_major_group(
    layer: int, heads: int, items, lane_ids: list[list[array]], lane_lens: list[list[int]], num_decode: int, bs: int
) -> LayerGroupMetadata:
    """One head-major layer's group: ``lane_ids[i][h]`` / ``lane_lens[i][h]`` are item ``i``'s lane ``h``'s
    block ids and slots before the step. Every lane of an item takes the item's tokens at its own end.
    Built for all lanes at once (``head_major_group_reference`` is the per-position definition)."""
    block_ids = [ids for lanes in lane_ids for ids in lanes]  # row r = item * heads + head
    kv_lens = [k for lens in lane_lens for k in lens]
    counts = np.array([n for _, n in items], dtype=np.int64)
    before = np.array(kv_lens, dtype=np.int64)
    row_n = counts.repeat(heads)
    have = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    over = before + row_n > have * bs
    if over.any():
        r = int(np.argmax(over))
        raise IndexError(f"positions [{before[r]}, {before[r] + row_n[r]}) outside the table's {have[r] * bs} slots")
    # Entry e of row r is the row's token t: position before[r] + t, stored token-major (t * heads + h).
    offsets = np.zeros(len(block_ids), dtype=np.int64)
    np.cumsum(have[:-1], out=offsets[1:])
    flat = np.frombuffer(bytearray().join(block_ids), dtype=np.int32) if block_ids else np.zeros(0, np.int32)
    row = np.arange(len(block_ids)).repeat(row_n)
    row_first = np.zeros(len(block_ids), dtype=np.int64)
    np.cumsum(row_n[:-1], out=row_first[1:])
    t = np.arange(row.size) - row_first[row]
    pos = before[row] + t
    item_first = row_first[::heads] if heads else row_first
    dest = item_first.repeat(row_n[::heads] * heads) + t * heads + row % heads
    slots = np.empty(row.size, dtype=np.int32)
    slots[dest] = flat[offsets[row] + pos // bs] * bs + pos % bs
    qo_indptr, prefill_rows = _prefill_lanes(counts[num_decode:], heads)
    return _lists(
        (layer,),
        kv_lens,
        block_ids,
        slots,
        (before + row_n).tolist(),
        [0] * len(kv_lens),
        num_decode * heads,
        qo_indptr,
        bs,
        heads=heads,
        prefill_rows=prefill_rows,
    )


def _prefill_lanes(counts: np.ndarray, heads: int) -> tuple[np.ndarray, torch.Tensor | None]:
    """The prefill lanes' ``qo_indptr`` (each item's token count once per head) and ``prefill_rows``: in lane
    order (item, head, token), each query's row ``token * heads + head`` of the token-major query view."""
    qo_indptr = np.zeros(counts.size * heads + 1, dtype=np.int32)
    np.cumsum(counts.repeat(heads), out=qo_indptr[1:])
    if not counts.size:
        return qo_indptr, None
    tokens = np.arange(int(counts.sum())).reshape(1, -1)
    firsts = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=firsts[1:])
    lanes = np.arange(heads)[:, None]
    rows = [(tokens[:, f : f + n] * heads + lanes).reshape(-1) for f, n in zip(firsts, counts, strict=True)]
    return qo_indptr, torch.from_numpy(np.concatenate(rows))


def head_major_group_reference(
    layer: int, heads: int, items, lane_ids: list[list[array]], lane_lens: list[list[int]], num_decode: int, bs: int
) -> LayerGroupMetadata:
    """``head_major_group`` position by position, in plain Python (the definition tests hold it to)."""
    slots: list[int] = []
    ends, block_ids, kv_lens = [], [], []
    for (_, n), ids, lens in zip(items, lane_ids, lane_lens, strict=True):
        per_lane = [_slots(ids[h], lens[h], lens[h] + n, bs) for h in range(heads)]
        slots += [per_lane[h][t] for t in range(n) for h in range(heads)]  # token-major, as K/V come
        ends += [k + n for k in lens]
        block_ids += ids
        kv_lens += lens
    qo_indptr, prefill_rows, first = [0], [], 0
    for _, n in items[num_decode:]:
        for h in range(heads):
            qo_indptr.append(qo_indptr[-1] + n)
            prefill_rows += range(first * heads + h, (first + n) * heads, heads)
        first += n
    rows = torch.tensor(prefill_rows, dtype=torch.int64) if prefill_rows else None
    skips, decode_rows = [0] * len(ends), num_decode * heads
    extra = dict(heads=heads, prefill_rows=rows)
    return _lists((layer,), kv_lens, block_ids, slots, ends, skips, decode_rows, qo_indptr, bs, **extra)


def decode_groups(
    request_ids: list, kv_lens: np.ndarray, arrays_of: Callable[..., Sequence[array]], bs: int, layout: LayerLayout
) -> list[LayerGroupMetadata]:
    """A decode-only step's groups in a layout with a table per layer (or per lane): one per layer, built
    for all layers at once. ``kv_lens`` int64 ``[B, L, H]``: each request's lanes' slots before the step
    (``H`` 1 without lanes); ``arrays_of(request_id)``: the block ids of each of its tables. Equal to
    ``_group`` / ``head_major_group`` per layer (rows of a layer: item-major, then head)."""
    num_items, num_layers, heads = kv_lens.shape
    rows = num_items * heads
    # Row r of layer l (r = item * heads + head) is table l * heads + head of its item: layer-major order.
    tables = [arrays_of(rid) for rid in request_ids]
    if heads == 1:
        arrays = list(itertools.chain.from_iterable(zip(*tables, strict=True)))
    else:
        lanes = (t[lyr * heads : (lyr + 1) * heads] for lyr in range(num_layers) for t in tables)
        arrays = list(itertools.chain.from_iterable(lanes))
    before = kv_lens.transpose(1, 0, 2).reshape(-1)  # [L * rows]
    num_blocks = before // bs + 1  # blocks listed: through the one the step's token goes to
    have = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if (num_blocks > have).any():
        r = int(np.argmax(num_blocks > have))
        raise IndexError(f"positions [{before[r]}, {before[r] + 1}) outside the table's {have[r] * bs} slots")
    skips = np.zeros_like(before)
    if layout.windowed:  # a windowed layer's lists start at the first block its query reads
        windows = np.array([-1 if w is None else w for w in layout.window_left], dtype=np.int64).repeat(rows)
        slid = windows >= 0
        skips[slid] = np.maximum(0, before[slid] - windows[slid]) // bs
    listed = arrays
    cut = np.flatnonzero((skips > 0) | (num_blocks < have))
    if cut.size:  # a list that leaves blocks off takes a slice (whole tables join as they are)
        listed = list(arrays)
        for r, skip, end in zip(cut.tolist(), skips[cut].tolist(), num_blocks[cut].tolist(), strict=True):
            listed[r] = arrays[r][skip:end]
    indices = np.frombuffer(bytearray().join(listed), dtype=np.int32) if listed else np.zeros(0, np.int32)
    counts = num_blocks - skips
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    last_len = (before + 1 - (num_blocks - 1) * bs).astype(np.int32)
    slots = (indices[indptr[1:] - 1].astype(np.int64) * bs + before % bs).astype(np.int32)
    starts = indptr[:-1:rows] if rows else np.zeros(num_layers, np.int64)
    local = (indptr[np.arange(num_layers)[:, None] * rows + np.arange(rows + 1)] - starts[:, None]).astype(np.int32)
    t_indices, t_indptr = torch.from_numpy(indices), torch.from_numpy(local)
    t_last, t_slots = torch.from_numpy(last_len).view(num_layers, rows), torch.from_numpy(slots).view(num_layers, rows)
    zero, empty = torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    ends = indptr[rows::rows].tolist() if rows else [0] * num_layers
    lens_of = before.reshape(num_layers, rows).tolist()
    return [
        LayerGroupMetadata(
            layers=(lyr,),
            kv_lens=tuple(lens_of[lyr]),
            block_ids=tuple(arrays[lyr * rows : (lyr + 1) * rows]),
            slot_mapping=t_slots[lyr],
            decode_kv_indptr=t_indptr[lyr],
            decode_kv_indices=t_indices[int(starts[lyr]) : ends[lyr]],
            decode_kv_last_len=t_last[lyr],
            prefill_qo_indptr=zero,
            prefill_kv_indptr=zero,
            prefill_kv_indices=empty,
            prefill_kv_last_len=empty,
            heads=heads,
            prefill_rows=None,
        )
        for lyr in range(num_layers)
    ]


def build_step_metadata(
    batch: ScheduledBatch,
    table_of: Callable[..., BlockTable],
    block_size: int,
    block_ids_of: Callable[..., array] | None = None,
    *,
    layout: LayerLayout | None = None,
    block_id_arrays_of: Callable[..., Sequence[array]] | None = None,
) -> StepMetadata:
    """Lay out a scheduled batch (decodes first, as the scheduler orders it) as step tensors.

    ``table_of(request_id)`` (``table_of(request_id, layer)`` when ``layout`` gives each layer its own
    table): a request's block table.
    ``layout``: the tables' layout (None: one table for every layer). A windowed layer's block lists
    leave off the blocks before the first one its queries read (``LayerLayout.first_read_block``;
    ``LayerGroupMetadata`` keeps all ``block_ids``).
    ``block_ids_of``: the same signature, its block ids as an ``array('i')`` equal to the table's
    ``block_ids`` (``KVCacheManager.block_id_array``), which saves converting every listed block id each
    step; without it they are converted from the tables (same result).
    ``block_id_arrays_of(request_id)``: optional, every table's ``block_ids_of`` at once, in table order
    (``KVCacheManager.block_id_arrays``; one call per request for a table per layer or lane).
    """
    per_layer = layout is not None and layout.per_layer
    heads = layout.heads if per_layer else 1
    input_ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    steps: list[RequestStep] = []
    row_starts: list[int] = []
    num_decode = 0
    lanes = None  # head-major: every request's lane lengths [B, L, H], and each layer's longest lane
    if heads > 1 and batch.items:
        lanes = np.array([req.kv_lens for req, _ in batch.items], dtype=np.int64).reshape(len(batch.items), -1, heads)
        layer_lens = [tuple(x) for x in lanes.max(axis=2).tolist()]
    for i, (req, n) in enumerate(batch.items):
        start = req.num_computed_tokens
        row_starts.append(len(input_ids))
        replay = req.num_replays_done if req.replaying else None  # a replay pass: its tokens, nothing sampled
        input_ids += req.token_ids[start : start + n] if replay is None else req.next_replay
        positions += range(start, start + n)
        kv_lens = tuple(req.kv_lens) if heads == 1 else layer_lens[i]  # a layer's longest lane
        steps.append(RequestStep(req.request_id, start, n, req.prefill_len, kv_lens, replay, req.state_to_resume))
        if n == 1:
            if num_decode != len(steps) - 1:
                raise ValueError("single-token items must come before prefill chunks")
            num_decode += 1
        if replay is None and start + n == req.num_tokens:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(req)
    num_layers = len(steps[0].kv_lens) if steps else 1
    if per_layer and steps and num_decode == len(steps):  # decodes only: every layer's lists at once
        if block_id_arrays_of is None:
            ids_of = block_ids_of or (lambda *key: array("i", table_of(*key).block_ids))
            block_id_arrays_of = lambda rid: [ids_of(rid, t) for t in range(layout.num_tables)]  # noqa: E731
        lens = lanes if lanes is not None else np.array([s.kv_lens for s in steps], dtype=np.int64)[:, :, None]
        groups = decode_groups([s.request_id for s in steps], lens, block_id_arrays_of, block_size, layout)
    elif heads > 1:
        ids_of = block_ids_of or (lambda *key: array("i", table_of(*key).block_ids))
        groups = []
        for layer in range(num_layers):
            lanes = layout.lanes(layer)
            lane_ids = [[ids_of(req.request_id, t) for t in lanes] for req, _ in batch.items]
            lane_lens = [[req.kv_lens[t] for t in lanes] for req, _ in batch.items]
            groups.append(head_major_group(layer, heads, batch.items, lane_ids, lane_lens, num_decode, block_size))
    else:
        groups = None
    if groups is not None:
        layers = tuple(range(num_layers))
        return _metadata(input_ids, positions, num_decode, groups, layers, steps, row_starts, logits_indices, sampled)
    # Column ``layer`` of the requests' KV lengths; layers with equal columns (and tables) share a group.
    columns = zip(*(s.kv_lens for s in steps), strict=True) if steps else [()] * num_layers
    by_lens: dict[tuple, list[int]] = {}
    for layer, kv_lens in enumerate(columns):
        by_lens.setdefault((layer if per_layer else 0, kv_lens), []).append(layer)
    ids_of = block_ids_of or (lambda *key: array("i", table_of(*key).block_ids))
    groups, layer_group = [], [0] * num_layers
    for g, ((table, kv_lens), layers) in enumerate(by_lens.items()):
        key = (table,) if per_layer else ()
        block_ids = [ids_of(step.request_id, *key) for step in steps]
        first_read = None
        if per_layer and layout.windowed and layout.window(table) is not None:
            first_read = functools.partial(layout.first_read_block, table, block_size=block_size)
        groups.append(_group(tuple(layers), kv_lens, batch.items, block_ids, num_decode, block_size, first_read))
        for layer in layers:
            layer_group[layer] = g
    return _metadata(
        input_ids, positions, num_decode, groups, tuple(layer_group), steps, row_starts, logits_indices, sampled
    )


def _metadata(
    input_ids, positions, num_decode, groups, layer_group, steps, row_starts, logits_indices, sampled
) -> StepMetadata:
    return StepMetadata(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        num_decode_tokens=num_decode,
        num_prefill_requests=len(steps) - num_decode,
        groups=tuple(groups),
        layer_group=layer_group,
        steps=tuple(steps),
        row_starts=tuple(row_starts),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        sampled=tuple(sampled),
    )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device``: pinned and non-blocking on CUDA, a no-op on CPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_device_buffer(t: torch.Tensor, buffer: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``to_device`` into the front of a fixed device ``buffer`` (a CUDA graph keeps reading its address);
    a new tensor when there is no buffer, on CPU, or for a one-off larger step (whole-prompt prefill)."""
    n = t.numel()
    if buffer is None or n > buffer.numel() or device.type == "cpu":
        return to_device(t, device)
    view = buffer[:n]
    view.copy_(t.pin_memory(), non_blocking=True)
    return view


def table_slots(block_ids: Sequence[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Pool slots of a table's first ``num_tokens`` positions, int64 on the host."""
    num_blocks = -(-num_tokens // block_size)
    if isinstance(block_ids, array) and block_ids:  # the manager's packed ids: no per-element conversion
        blocks = torch.from_numpy(np.frombuffer(block_ids, dtype=np.int32)[:num_blocks].astype(np.int64))
    else:
        blocks = torch.tensor(block_ids[:num_blocks], dtype=torch.int64)
    return (blocks.view(-1, 1) * block_size + torch.arange(block_size)).view(-1)[:num_tokens]
