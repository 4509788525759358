"""``apply_compactions`` reading keeps from batched rounds' tensors (``Compaction.rows``) equals each
request's ``apply_compaction`` (the reference): requests on one shared table or per-layer tables, layers
of different kept counts (PyramidKV), rounds whose rows are out of request order or split in two,
requests mixing round rows, plain keeps and unchanged layers; and it rejects a kept index outside its
layer's slots, naming the layer."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_methods import Compaction, KeepRows
from sparse_serve.kv_compaction import apply_compaction, apply_compactions
from sparse_serve.kv_pool import KVPool

BS, HKV, D, LAYERS, BLOCKS = 4, 2, 8, 3, 16


def _keep(n: int, m: int, rng: random.Random) -> torch.Tensor:
    return torch.tensor([sorted(rng.sample(range(n), m)) for _ in range(HKV)], dtype=torch.int64)


def _case(seed: int):
    """Requests (tables, kv_lens, compaction) whose layers keep round rows, plain keeps or nothing."""
    rng = random.Random(seed)
    num = rng.randint(2, 4)
    free = list(range(BLOCKS))
    rng.shuffle(free)
    tables, lens = [], []
    for _ in range(num):
        ids = [free.pop() for _ in range(3)]
        tables.append([ids] * LAYERS if rng.random() < 0.5 else [list(ids) for _ in range(LAYERS)])
        base = rng.randint(6, 12)
        lens.append([base if tables[-1][0] is tables[-1][1] else rng.randint(6, 12) for _ in range(LAYERS)])
    keep = [[None] * LAYERS for _ in range(num)]
    rows = [[None] * LAYERS for _ in range(num)]
    for layer in range(LAYERS):
        width = rng.randint(0, 6)  # a layer's budget (per-layer budgets: PyramidKV)
        kinds = [rng.choice("rrrpn") for _ in range(num)]  # a round's row, a plain keep, unchanged
        in_round = [i for i, k in enumerate(kinds) if k == "r"]
        rng.shuffle(in_round) if rng.random() < 0.3 else None  # rows out of request order
        cut = rng.randint(0, len(in_round))  # the round in two chunks
        for chunk in (in_round[:cut], in_round[cut:]):
            if not chunk:
                continue
            batch = torch.stack([_keep(lens[i][layer], width, rng) for i in chunk])
            for row, (i, view) in enumerate(zip(chunk, batch.unbind(0), strict=True)):
                keep[i][layer], rows[i][layer] = view, KeepRows(batch, row)
        for i, k in enumerate(kinds):
            if k == "p":
                keep[i][layer] = _keep(lens[i][layer], rng.randint(0, 6), rng)
    return [(t, n, Compaction(tuple(k), rows=tuple(r))) for t, n, k, r in zip(tables, lens, keep, rows, strict=True)]


def _pool(seed: int) -> KVPool:
    gen = torch.Generator().manual_seed(seed)
    make = lambda: tuple(torch.randn(BLOCKS, BS, HKV, D, generator=gen) for _ in range(LAYERS))  # noqa: E731
    return KVPool.from_tensors(make(), make())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**20))
def test_a_step_from_round_rows_equals_each_request_alone(seed):
    requests = _case(seed)
    plain = [(t, n, Compaction(c.keep)) for t, n, c in requests]
    pools = [_pool(seed) for _ in range(3)]
    got = apply_compactions(pools[0], requests, BS)
    without_rows = apply_compactions(pools[1], plain, BS)
    ref = [apply_compaction(pools[2], t, n, c, BS) for t, n, c in requests]
    assert got == without_rows == ref
    for pool in pools[:2]:
        for layer in range(LAYERS):
            assert torch.equal(pool.k[layer], pools[2].k[layer]) and torch.equal(pool.v[layer], pools[2].v[layer])


@pytest.mark.parametrize("bad", [-1, 12])
def test_a_round_row_outside_its_layer_is_rejected(bad):
    rng = random.Random(1)
    batch = torch.stack([_keep(12, 5, rng) for _ in range(2)])
    batch[1, 0, -1 if bad > 0 else 0] = bad
    requests = [
        (
            [[2 * i, 2 * i + 1, 8 + i]] * LAYERS,
            [12] * LAYERS,
            Compaction((None, row, None), rows=(None, KeepRows(batch, i), None)),
        )
        for i, row in enumerate(batch.unbind(0))
    ]
    with pytest.raises(ValueError, match="layer 1: kept index outside"):
        apply_compactions(_pool(0), requests, BS)
