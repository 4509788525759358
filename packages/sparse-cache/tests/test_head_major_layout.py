"""The head-major layout: one table per (layer, KV head) lane, so a layer's heads may hold different
numbers of tokens. A hypothesis state machine grows every lane of a request by the same chunk, compacts
lanes to ragged per-head counts and saves / resumes chains: every block has one owner, free + used is
the pool, each lane holds ceil(kept / block_size) blocks; the per-layer block bound holds."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparse_cache import KVCacheManager, LayerLayout, LayerTables, head_major_paged

BS, LAYERS, HEADS, POOL = 4, 2, 3, 60


def test_layout_lanes_and_counts():
    layout = LayerLayout.head_major(LAYERS, HEADS)
    assert layout.num_tables == layout.num_lens == 6 and list(layout.lanes(1)) == [3, 4, 5]
    assert layout.per_table([5, 2]) == [5, 5, 5, 2, 2, 2]
    assert layout.per_table([1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5, 6]
    assert layout.layer_lens([1, 7, 3, 4, 0, 6]) == (7, 6)
    assert layout.num_blocks([1, 7, 3, 4, 0, 6], BS) == 1 + 2 + 1 + 1 + 0 + 2  # exact per lane
    with pytest.raises(ValueError, match="head-major"):
        LayerLayout(2, False, (), 3)
    with pytest.raises(ValueError, match="head-major"):
        LayerLayout(2, True, (4, None), 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=HEADS, max_size=HEADS))
def test_per_layer_average_bounds_every_ragged_split(lens):
    """A layer whose heads hold ``lens`` takes at most the blocks the per-head average is planned for."""
    layout = LayerLayout(1, True, (None,), HEADS)
    exact = layout.num_blocks(lens, BS)
    assert exact <= layout.num_blocks([-(-sum(lens) // HEADS)], BS)
    assert exact <= sum(lens) // BS + HEADS  # the brief's bound: budget x H / block_size + H


def test_head_major_store_holds_one_head_per_block():
    store = head_major_paged(16, 8, 128)
    assert store.head_major and [t.shape for t in store.block_tensors] == [(16, 1, 128)] * 2
    assert store.bytes_per_block(2) == 2 * 16 * 128 * 2


class HeadMajorMachine(RuleBasedStateMachine):
    """Requests prefill and decode in chunks (every lane grows alike), compact to ragged per-lane counts,
    finish, or end a turn on a chain that a later request resumes."""

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(POOL, BS, layout=LayerLayout.head_major(LAYERS, HEADS), enable_prefix_caching=False)
        self.lens: dict[int, list[int]] = {}  # per lane
        self.chains: dict[str, list[int]] = {}  # idle chains' per-lane lengths
        self.owner: dict[str, int] = {}  # busy chains' requests
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(n=st.integers(1, 12))
    def start(self, n):
        rid = self._new_id()
        self.m.resume_chain(rid, f"c{rid}", list(range(n)))  # a new chain, its turn now running
        if self.m.allocate(rid, [n] * LAYERS) is None:
            assert not self.m.has_request(rid)
            return
        self.lens[rid] = [n] * (LAYERS * HEADS)
        self.owner[f"c{rid}"] = rid

    @precondition(lambda self: self.lens)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6))
    def extend(self, i, n):
        rid = sorted(self.lens)[i % len(self.lens)]
        grown = [k + n for k in self.lens[rid]]
        if self.m.allocate(rid, grown, write_from=self.lens[rid]) is not None:
            self.lens[rid] = grown

    @precondition(lambda self: self.lens)
    @rule(i=st.integers(0, 100), fractions=st.lists(st.floats(0, 1), min_size=LAYERS * HEADS, max_size=LAYERS * HEADS))
    def compact(self, i, fractions):
        rid = sorted(self.lens)[i % len(self.lens)]
        kept = [int(k * f) for k, f in zip(self.lens[rid], fractions, strict=True)]
        released = self.m.shrink(rid, kept)
        assert len(released) == sum(-(-a // BS) - -(-b // BS) for a, b in zip(self.lens[rid], kept, strict=True))
        self.lens[rid] = kept

    @precondition(lambda self: self.lens)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        rid = sorted(self.lens)[i % len(self.lens)]
        self.m.free(rid)  # its chain stays busy, holding nothing
        del self.lens[rid]

    @precondition(lambda self: self.lens)
    @rule(i=st.integers(0, 100))
    def save_chain(self, i):
        rid = sorted(self.lens)[i % len(self.lens)]
        chain = next(c for c, owner in self.owner.items() if owner == rid)
        lens = self.lens.pop(rid)
        self.m.save_chain(rid, chain, list(range(max(lens) + 1)), lens)
        self.chains[chain] = lens
        del self.owner[chain]

    @precondition(lambda self: self.chains)
    @rule(i=st.integers(0, 100))
    def resume_chain(self, i):
        chain = sorted(self.chains)[i % len(self.chains)]
        lens = self.chains[chain]
        rid = self._new_id()
        checkout = self.m.resume_chain(rid, chain, list(range(max(lens) + 2)))
        if checkout.table is None:  # its KV was reclaimed for room: the turn ends holding nothing
            del self.chains[chain]
            self.m.save_chain(rid, chain, list(range(max(lens) + 2)), ())
            return
        assert isinstance(checkout.table, LayerTables) and list(checkout.kv_lens) == lens
        del self.chains[chain]
        self.lens[rid] = list(lens)
        self.owner[chain] = rid

    @invariant()
    def each_block_has_one_owner_and_the_pool_adds_up(self):
        holders, lane_of = Counter(), {}
        for rid in self.lens:
            for lane in range(LAYERS * HEADS):
                ids = self.m.table(rid, lane).block_ids
                holders.update(ids)
                for b in ids:
                    assert lane_of.setdefault(b, (rid, lane)) == (rid, lane)  # one lane owns a block
        chain_blocks = self.m.num_blocks - self.m.num_free_blocks - sum(holders.values())
        assert chain_blocks == sum(self.m.chains.info(c).num_blocks for c in self.chains)
        assert self.m.num_free_blocks + self.m.pool.num_used_blocks == self.m.num_blocks == POOL

    @invariant()
    def each_lane_holds_its_kept_tokens(self):
        for rid, lens in self.lens.items():
            for lane, n in enumerate(lens):
                assert len(self.m.table(rid, lane).block_ids) == -(-n // BS)
                assert self.m.table(rid, lane).num_tokens == n
            assert self.m.num_held_blocks(rid) == self.m.num_blocks_for(lens)


TestHeadMajorMachine = HeadMajorMachine.TestCase
TestHeadMajorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
