"""apply_compaction against a per-layer, per-element oracle (one bounds check for every layer), and
rewritten_slots (one host read) against its per-layer reference."""

from __future__ import annotations

import pytest
import torch

from sparse_methods import Compaction
from sparse_serve.chains import rewritten_slots, rewritten_slots_reference
from sparse_serve.kv_compaction import apply_compaction
from sparse_serve.kv_pool import KVPool

BS, HKV, D = 4, 2, 8


def _keep(n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.sort(torch.randperm(n, generator=gen)[:m]).values for _ in range(HKV)])


def _pool(num_layers: int, gen: torch.Generator) -> KVPool:
    make = lambda: tuple(torch.randn(12, BS, HKV, D, generator=gen) for _ in range(num_layers))  # noqa: E731
    return KVPool.from_tensors(make(), make())


@pytest.mark.parametrize("uniform", [True, False])
def test_apply_compaction_matches_a_per_layer_oracle(uniform):
    gen = torch.Generator().manual_seed(3)
    pool = _pool(4, gen)
    block_ids = [7, 2, 9, 0, 5, 11]  # 24 slots
    kv_lens = [21, 21, 23, 21]
    kept = [10, 10, 10, 10] if uniform else [10, 3, 17, 10]
    keep = [_keep(n, m, gen) for n, m in zip(kv_lens, kept, strict=True)]
    keep[1] = None  # a layer left unchanged
    expected_k = [c.clone() for c in pool.k]
    expected_v = [c.clone() for c in pool.v]
    for layer, kp in enumerate(keep):
        if kp is None:
            continue
        for cache in (expected_k[layer], expected_v[layer]):
            flat, old = cache.view(-1, HKV, D), cache.clone().view(-1, HKV, D)
            slots = [b * BS + o for b in block_ids for o in range(BS)]
            for h in range(HKV):
                for i in range(kp.shape[1]):
                    flat[slots[i], h] = old[slots[kp[h, i]], h]
    new_lens = apply_compaction(pool, block_ids, kv_lens, Compaction(tuple(keep)), BS)
    assert new_lens == [k.shape[1] if k is not None else n for k, n in zip(keep, kv_lens, strict=True)]
    for layer in range(4):
        torch.testing.assert_close(pool.k[layer], expected_k[layer], rtol=0, atol=0)
        torch.testing.assert_close(pool.v[layer], expected_v[layer], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1, 21])
def test_apply_compaction_rejects_indices_outside_the_layer(bad):
    gen = torch.Generator().manual_seed(4)
    pool = _pool(2, gen)
    keep = [_keep(21, 5, gen), _keep(21, 5, gen)]
    keep[1][1, -1 if bad > 0 else 0] = bad
    with pytest.raises(ValueError, match="layer 1: kept index outside"):
        apply_compaction(pool, [0, 1, 2, 3, 4, 5], [21, 21], Compaction(tuple(keep)), BS)
    with pytest.raises(ValueError, match="layer 0: keeps"):
        apply_compaction(pool, [0, 1, 2, 3, 4, 5], [4, 21], Compaction((keep[0], None)), BS)


def test_rewritten_slots_equals_its_reference():
    gen = torch.Generator().manual_seed(5)
    in_place = torch.arange(6).expand(HKV, 6)
    tail_dropped = torch.arange(9).expand(HKV, 9)
    cases = [
        (None, None),
        (in_place, None),
        (in_place, tail_dropped),
        (in_place, torch.empty(HKV, 0, dtype=torch.int64)),
    ]
    for _ in range(30):
        n = int(torch.randint(4, 30, (1,), generator=gen))
        cases.append(tuple(_keep(n, int(torch.randint(1, n + 1, (1,), generator=gen)), gen) for _ in range(3)))
    moved = torch.stack([torch.arange(5), torch.tensor([0, 1, 2, 4, 6])])  # one head moves from column 3
    cases.append((in_place, moved))
    for keep in cases:
        assert rewritten_slots(Compaction(keep)) == rewritten_slots_reference(Compaction(keep))
    assert rewritten_slots(Compaction((in_place, moved))) == (3, 5)
    assert rewritten_slots(Compaction((in_place, tail_dropped))) is None
