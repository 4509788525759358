"""Step metadata: the packed block-id path equals the one converting the tables, and both equal a
plain per-position computation (slots, CSR lists, layer groups), with one table for every layer or
one per layer (then every layer is its own group, over its own table)."""

import random

import pytest
import torch

from sparse_cache import KVCacheManager, LayerLayout
from sparse_serve.request import Request
from sparse_serve.sampling_params import SamplingParams
from sparse_serve.scheduler import ScheduledBatch
from sparse_serve.step_metadata import (
    LayerGroupMetadata,
    _group,
    build_step_metadata,
    head_major_group,
    head_major_group_reference,
)

BS = 4


def _batch(seed: int, num_layers: int = 3, per_layer: bool = False, decodes_only: bool = False, layout=None):
    rng = random.Random(seed)
    if layout is None and per_layer:
        layout = LayerLayout(num_layers, True, (None,) * num_layers)
    kv = KVCacheManager(num_blocks=400 * num_layers, block_size=BS, layout=layout)
    lens = layout.num_lens if layout is not None else num_layers
    items = []
    for i in range(rng.randint(1, 9)):
        decode = decodes_only or (i < 5 and rng.random() < 0.7)
        n = 1 if decode else rng.randint(2, 11)
        done = rng.randint(1 if decode else 0, 40)
        req = Request(str(i), [rng.randrange(50) for _ in range(done + n)], SamplingParams(), arrival=0)
        req.num_computed_tokens = done
        evict = rng.random() < 0.3  # some layers hold fewer slots: several layer groups
        req.kv_lens = [done - (rng.randint(0, done) if evict and layer % 2 else 0) for layer in range(lens)]
        kv.allocate(req.request_id, rng.randint(0, 3))  # a table grown over several steps
        grown = [k + n for k in req.kv_lens] if per_layer else max(req.kv_lens) + n
        assert kv.allocate(req.request_id, grown) is not None
        items.append((req, n))
    items.sort(key=lambda item: item[1] > 1)
    return ScheduledBatch(tuple(items)), kv


def _plain_group(batch: ScheduledBatch, kv: KVCacheManager, layer: int) -> dict:
    """Slots and CSR lists of one layer, position by position."""
    slots, lists = [], []
    for req, n in batch.items:
        table = kv.table(req.request_id, layer)
        start = req.kv_lens[layer]
        slots += [table.slot(p) for p in range(start, start + n)]
        lists.append((table.block_ids[: -(-(start + n) // BS)], (start + n - 1) % BS + 1))
    return {"slots": slots, "lists": lists}


def _csr_lists(indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor):
    ptr = indptr.tolist()
    return [(indices[ptr[b] : ptr[b + 1]].tolist(), int(last[b])) for b in range(len(ptr) - 1)]


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_packed_block_ids_equal_tables_and_plain_layout(seed, per_layer):
    batch, kv = _batch(seed, per_layer=per_layer)
    fast = build_step_metadata(batch, kv.table, BS, kv.block_id_array, layout=kv.layout)
    slow = build_step_metadata(batch, kv.table, BS, layout=kv.layout)
    assert fast.layer_group == slow.layer_group and len(fast.groups) == len(slow.groups)
    if per_layer:
        assert fast.layer_group == (0, 1, 2)
    for a, b in zip(fast.groups, slow.groups, strict=True):
        for name in LayerGroupMetadata.__slots__:
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y), name
            else:
                assert x == y, name
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(fast, name), getattr(slow, name))
    nd = fast.num_decode_tokens
    for layer in range(3):
        group = fast.groups[fast.layer_group[layer]]
        assert layer in group.layers
        plain = _plain_group(batch, kv, layer)
        assert group.slot_mapping.tolist() == plain["slots"]
        decode = _csr_lists(group.decode_kv_indptr, group.decode_kv_indices, group.decode_kv_last_len)
        prefill = _csr_lists(group.prefill_kv_indptr, group.prefill_kv_indices, group.prefill_kv_last_len)
        assert decode + prefill == plain["lists"] and len(decode) == nd


@pytest.mark.parametrize("seed", range(20))
def test_windowed_layers_list_from_their_first_read_block(seed):
    """With a window on layer 1, its lists leave off the blocks before the first one its queries read
    (the same rule by which the manager gives them back); the other layers and the slots are unchanged."""
    batch, kv = _batch(seed, per_layer=True)
    layout = LayerLayout(3, True, (None, 5, None))
    meta = build_step_metadata(batch, kv.table, BS, kv.block_id_array, layout=layout)
    for layer in range(3):
        group = meta.groups[meta.layer_group[layer]]
        plain = _plain_group(batch, kv, layer)
        assert group.slot_mapping.tolist() == plain["slots"]
        expected = []
        for (req, _), (ids, last) in zip(batch.items, plain["lists"], strict=True):
            skip = layout.first_read_block(layer, req.kv_lens[layer], BS)
            assert skip == (max(0, req.kv_lens[layer] - 5) // BS if layer == 1 else 0)
            expected.append((ids[skip:], last))  # the last block (and its length) always stays
        decode = _csr_lists(group.decode_kv_indptr, group.decode_kv_indices, group.decode_kv_last_len)
        prefill = _csr_lists(group.prefill_kv_indptr, group.prefill_kv_indices, group.prefill_kv_last_len)
        assert decode + prefill == expected


def test_a_position_outside_the_table_raises():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    req = Request("r", list(range(BS + 1)), SamplingParams(), arrival=0, kv_lens=[BS] * 3)
    req.num_computed_tokens = BS
    kv.allocate("r", BS)  # one block: no room for the step's token at position BS
    for block_ids_of in (None, kv.block_id_array):
        with pytest.raises(IndexError):
            build_step_metadata(ScheduledBatch(((req, 1),)), kv.table, BS, block_ids_of)


@pytest.mark.parametrize("kind", ["per_layer", "windowed", "head_major"])
@pytest.mark.parametrize("seed", range(15))
def test_decode_steps_build_every_layer_at_once_as_layer_by_layer(seed, kind):
    """A decode-only step's groups (all layers' lists built together) equal the groups built one layer at a
    time, with a table per layer, with windowed layers, and with a table per (layer, KV head) lane."""
    layout = {
        "per_layer": LayerLayout(3, True, (None,) * 3),
        "windowed": LayerLayout(3, True, (None, 5, 2)),
        "head_major": LayerLayout.head_major(3, 2),
    }[kind]
    batch, kv = _batch(seed, per_layer=True, decodes_only=True, layout=layout)
    arrays_of = kv.block_id_arrays if seed % 2 else None  # every table at once, or table by table
    meta = build_step_metadata(batch, kv.table, BS, kv.block_id_array, layout=layout, block_id_arrays_of=arrays_of)
    assert meta.layer_group == (0, 1, 2) and meta.num_decode_tokens == len(batch.items)
    for layer, group in enumerate(meta.groups):
        if kind == "head_major":
            ids = [[kv.block_id_array(r.request_id, t) for t in layout.lanes(layer)] for r, _ in batch.items]
            lens = [[r.kv_lens[t] for t in layout.lanes(layer)] for r, _ in batch.items]
            ref = head_major_group(layer, 2, batch.items, ids, lens, len(batch.items), BS)
        else:
            first_read = None
            if layout.window(layer) is not None:
                first_read = lambda n, t=layer: layout.first_read_block(t, n, BS)  # noqa: E731
            kv_lens = tuple(r.kv_lens[layer] for r, _ in batch.items)
            ids = [kv.block_id_array(r.request_id, layer) for r, _ in batch.items]
            ref = _group((layer,), kv_lens, batch.items, ids, len(batch.items), BS, first_read)
        for name in LayerGroupMetadata.__slots__:
            x, y = getattr(group, name), getattr(ref, name)
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y), name
            else:
                assert x == y, name


# -- head-major groups: all lanes at once == the per-position definition ----------------------------------
def _lanes(batch, kv, layout, layer):
    ids = [[kv.block_id_array(r.request_id, t) for t in layout.lanes(layer)] for r, _ in batch.items]
    lens = [[r.kv_lens[t] for t in layout.lanes(layer)] for r, _ in batch.items]
    return ids, lens


@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("seed", range(25))
def test_head_major_group_equals_reference(seed, heads):
    layout = LayerLayout.head_major(3, heads)
    batch, kv = _batch(seed, per_layer=True, layout=layout)
    num_decode = sum(n == 1 for _, n in batch.items)
    for layer in range(3):
        ids, lens = _lanes(batch, kv, layout, layer)
        got = head_major_group(layer, heads, batch.items, ids, lens, num_decode, BS)
        ref = head_major_group_reference(layer, heads, batch.items, ids, lens, num_decode, BS)
        for name in LayerGroupMetadata.__slots__:
            x, y = getattr(got, name), getattr(ref, name)
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), name
            else:
                assert x == y, name


def test_mixed_step_uses_the_head_major_group():
    layout = LayerLayout.head_major(3, 2)
    batch, kv = _batch(3, per_layer=True, layout=layout)
    meta = build_step_metadata(batch, kv.table, BS, kv.block_id_array, layout=layout)
    num_decode = meta.num_decode_tokens
    for layer, group in enumerate(meta.groups):
        ids, lens = _lanes(batch, kv, layout, layer)
        ref = head_major_group_reference(layer, 2, batch.items, ids, lens, num_decode, BS)
        assert torch.equal(group.slot_mapping, ref.slot_mapping)
        assert torch.equal(group.prefill_kv_indices, ref.prefill_kv_indices)


def test_a_lane_without_room_is_an_index_error():
    layout = LayerLayout.head_major(1, 2)
    kv = KVCacheManager(num_blocks=16, block_size=BS, layout=layout)
    kv.allocate("r", [BS, 2 * BS])
    req = Request("r", list(range(BS + 1)), SamplingParams(), arrival=0, kv_lens=[BS, BS])
    req.num_computed_tokens = BS
    ids, lens = _lanes(ScheduledBatch(((req, 1),)), kv, layout, 0)
    for build in (head_major_group, head_major_group_reference):
        with pytest.raises(IndexError, match="outside the table"):
            build(0, 2, [(req, 1)], ids, lens, 1, BS)
