"""The per-layer layout of the KV manager: each layer's table draws from one pool, memory follows each
layer's length, windowed layers give back what their window no longer reads, and prefix hits, chains
and forks carry per-layer tables. Stateful tests: no block leaked or owned twice, free + used = pool,
every layer holds exactly the blocks its plan says."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparse_cache import BlockTable, KVCacheManager, LayerLayout, LayerTables

BS = 2
WINDOWS = (None, 3, None)  # layer 1 reads the 3 slots before each query (and its own)


def _layout(windows=WINDOWS) -> LayerLayout:
    return LayerLayout.choose(len(windows), windows)


def test_layout_choice():
    assert not LayerLayout.choose(3, (), [(5, 5, 5)]).per_layer
    assert LayerLayout.choose(3, (), [(5, 5, 5), (9, 7, 5)]).per_layer
    windowed = LayerLayout.choose(2, (-1, 4))
    assert windowed.per_layer and windowed.window_left == (None, 4) and windowed.num_tables == 2
    assert windowed.num_blocks([9, 9], 4) == 6 and LayerLayout(2).num_blocks([9, 3], 4) == 3
    assert windowed.first_read_block(1, 13, 4) == 2 and windowed.first_read_block(0, 13, 4) == 0
    assert windowed.window_peaks((100, 100), chunk=8, block_size=4) == (100, 16)
    assert windowed.num_blocks(100, 4, step=8) == 25 + 4 and windowed.num_blocks(100, 4) == 50
    with pytest.raises(ValueError):
        LayerLayout(2, False, (None, 4))


def test_per_layer_allocate_and_shrink_follow_each_layer():
    m = KVCacheManager(20, BS, layout=LayerLayout.choose(3, (), [(1, 2, 3)]))
    assert m.allocate("a", [7, 7, 7]) is not None and m.num_held_blocks("a") == 12
    assert m.shrink("a", [2, 4, 7]) and [len(m.table("a", layer).block_ids) for layer in range(3)] == [1, 2, 4]
    assert m.num_free_blocks == 20 - 7 and m.num_blocks_for([2, 4, 7]) == 7
    assert m.allocate("a", [3, 5, 8]) is not None and m.num_held_blocks("a") == 2 + 3 + 4


def test_windowed_layer_slides_and_prefix_hits_need_only_its_window():
    m = KVCacheManager(40, BS, layout=_layout())
    prompt = list(range(11))
    m.allocate("a", [11] * 3)
    m.cache_blocks("a", prompt, 11)
    released = m.slide("a", [11] * 3)  # layer 1 reads from slot 8 on: blocks 0..3 go back
    assert len(released) == 4 and m.table("a", 1).block_ids[:4] == [m.null_block] * 4
    hit = m.match_prefix(prompt + [1])  # 10 tokens: layer 1 needs blocks 3 and 4 (slots 7..9)
    assert hit.num_tokens == 10 and hit.table_block_ids[1][:3] == (m.null_block,) * 3
    assert hit.table_block_ids[1][3] != m.null_block  # freed, still cached, revived by the hit
    assert m.allocate("b", [12] * 3, prefix=hit) is not None
    assert m.num_held_blocks("b") == 6 + 3 + 6
    m.free("a")
    m.free("b")
    assert m.pool.num_used_blocks == 0 and m.num_blocks == 40 - 1  # the null block is outside the pool


def test_a_computed_request_takes_only_its_window():
    m = KVCacheManager(40, BS, layout=_layout())
    assert m.allocate_computed("a", [20, 20, 20], [19, 19, 19]) is not None
    ids = m.table("a", 1).block_ids  # a query at 19 reads slots 16.. (block 8 on)
    assert ids[:8] == [m.null_block] * 8 and len(ids) == 10
    assert m.num_held_blocks("a") == 10 + 2 + 10 and m.prefix_hit_tokens == 0
    m.slide("a", [19, 19, 19])
    assert m.num_held_blocks("a") == 22


def test_chains_keep_per_layer_tables():
    m = KVCacheManager(30, BS, layout=LayerLayout.choose(2, (), [(1, 2)]), enable_prefix_caching=False)
    tokens = list(range(9))
    m.resume_chain("a", "c", tokens)  # a new chain
    m.allocate("a", [9, 9])
    m.save_chain("a", "c", tokens, [3, 9])
    assert m.pool.num_used_blocks == 2 + 5
    fork = m.chains.fork("c")
    checkout = m.resume_chain("b", fork, tokens + [5])
    assert isinstance(checkout.table, LayerTables) and checkout.kv_lens == (3, 9)
    assert m.allocate("b", [4, 10], write_from=[3, 9]) is not None
    copies = m.take_copies()  # the written blocks were shared with chain "c": copied first
    assert [d for _, d in copies] == [m.table("b", 0).block_ids[1], m.table("b", 1).block_ids[4]]
    with pytest.raises(ValueError, match="layout"):
        m.attach("x", BlockTable(BS, [0]))


class LayerMachine(RuleBasedStateMachine):
    """Requests advance in chunks over a small vocabulary (prefixes collide); layers 0 and 2 may be
    compacted (eviction, without prefix caching), layer 1 slides over its window."""

    PREFIX_CACHING = True

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(40, BS, layout=_layout(), enable_prefix_caching=self.PREFIX_CACHING)
        self.tokens: dict[int, list[int]] = {}
        self.kv_lens: dict[int, list[int]] = {}
        self.next_id = 0

    def _advance(self, rid: int, toks: list[int], kv_lens: list[int]) -> None:
        self.tokens[rid], self.kv_lens[rid] = toks, kv_lens
        if self.PREFIX_CACHING:
            self.m.cache_blocks(rid, toks, len(toks))
        self.m.slide(rid, kv_lens)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def start(self, prompt):
        rid = self.next_id
        self.next_id += 1
        hit = self.m.match_prefix(prompt)
        free_before = self.m.num_free_blocks
        if self.m.allocate(rid, [len(prompt)] * 3, prefix=hit) is None:
            assert self.m.num_free_blocks == free_before and not self.m.has_request(rid)
            return
        self._advance(rid, list(prompt), [len(prompt)] * 3)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def extend(self, i, new):
        rid = sorted(self.tokens)[i % len(self.tokens)]
        kv_lens = [k + len(new) for k in self.kv_lens[rid]]
        if self.m.allocate(rid, kv_lens, write_from=self.kv_lens[rid]) is None:
            return
        self._advance(rid, self.tokens[rid] + new, kv_lens)

    @precondition(lambda self: self.tokens and not self.PREFIX_CACHING)
    @rule(i=st.integers(0, 100), keep=st.tuples(st.integers(0, 9), st.integers(0, 9)))
    def compact(self, i, keep):
        rid = sorted(self.tokens)[i % len(self.tokens)]
        old = self.kv_lens[rid]
        new = [min(old[0], keep[0]), old[1], min(old[2], keep[1])]
        self.m.shrink(rid, new)
        self.kv_lens[rid] = new

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        rid = sorted(self.tokens)[i % len(self.tokens)]
        self.m.free(rid)
        del self.tokens[rid], self.kv_lens[rid]

    @invariant()
    def each_block_has_one_owner_and_the_pool_adds_up(self):
        holders, layer_of = Counter(), {}
        for rid in self.tokens:
            for layer in range(3):
                ids = [b for b in self.m.table(rid, layer).block_ids if b != self.m.null_block]
                assert len(set(ids)) == len(ids)
                holders.update(ids)
                for b in ids:
                    assert layer_of.setdefault(b, layer) == layer  # no block in two layers' tables
        for b in range(self.m.num_blocks):
            assert self.m.pool.refcount(b) == holders.get(b, 0)
        assert self.m.num_free_blocks + self.m.pool.num_used_blocks == self.m.num_blocks == 40 - 1
        assert self.m.pool.num_used_blocks == len(holders) and self.m.null_block == 39

    @invariant()
    def each_layer_holds_its_plan(self):
        for rid, kv_lens in self.kv_lens.items():
            held = 0
            for layer, kv_len in enumerate(kv_lens):
                first = self.m.layout.first_read_block(layer, kv_len, BS)
                ids = self.m.table(rid, layer).block_ids
                assert len(ids) == -(-kv_len // BS)
                assert ids[:first] == [self.m.null_block] * first
                assert self.m.null_block not in ids[first:]
                held += len(ids) - first
                if WINDOWS[layer] is not None:
                    assert len(ids) - first <= -(-WINDOWS[layer] // BS) + 1
            assert self.m.num_held_blocks(rid) == held

    @invariant()
    def shared_blocks_hold_equal_tokens(self):
        owner: dict[int, tuple[int, list[int]]] = {}
        for rid, toks in self.tokens.items():
            for layer in range(3):
                for k, b in enumerate(self.m.table(rid, layer).block_ids):
                    if b == self.m.null_block:
                        continue
                    seen = owner.setdefault(b, (layer, k, toks[: (k + 1) * BS]))
                    assert seen == (layer, k, toks[: (k + 1) * BS])


class EvictingLayerMachine(LayerMachine):
    PREFIX_CACHING = False


TestLayerMachine = LayerMachine.TestCase
TestLayerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestEvictingLayerMachine = EvictingLayerMachine.TestCase
TestEvictingLayerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
