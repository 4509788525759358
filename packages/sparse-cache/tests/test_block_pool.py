"""Block pool: unit cases and a hypothesis state machine against a plain model of holders."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparse_cache import BlockPool, hash_block, root_hash


def test_allocate_answers_none_and_changes_nothing_when_short():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [3]


def test_release_more_than_held_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([b])


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    h = hash_block(root_hash(), [1, 2])
    pool.register(a, h)
    pool.release([a, b, c])
    # b and c hold nothing; a holds a cached prefix and should survive the next two allocations.
    assert sorted(pool.allocate(2)) == [b, c]
    assert pool.lookup(h) == a
    assert pool.allocate(1) == [a]
    assert pool.lookup(h) is None and pool.num_evictions == 1


def test_cached_blocks_evicted_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [hash_block(root_hash(), [i]) for i in range(3)]
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    pool.release([blocks[2]])
    pool.release([blocks[0]])
    pool.release([blocks[1]])
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(hashes[2]) is None
    assert pool.lookup(hashes[0]) == blocks[0]


def test_acquire_revives_a_free_cached_block():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block(root_hash(), [7])
    pool.register(a, h)
    pool.release([a])
    assert pool.num_free_blocks == 2
    pool.acquire([a])
    assert pool.refcount(a) == 1 and pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="holds no cached KV"):
        pool.acquire([1])


def test_duplicate_content_keeps_the_first_copy():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block(root_hash(), [1])
    assert pool.register(a, h)
    assert not pool.register(b, h)
    assert pool.lookup(h) == a and pool.block_hash(b) is None


class PoolMachine(RuleBasedStateMachine):
    """Holders are lists of block ids; the pool's refcounts must always equal how often each is held."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8)
        self.holders: list[list[int]] = []
        self.registered: dict[bytes, int] = {}
        self.counter = 0

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free_before = self.pool.num_free_blocks
        got = self.pool.allocate(n)
        if n > free_before:
            assert got is None and self.pool.num_free_blocks == free_before
            return
        assert got is not None and len(got) == n and len(set(got)) == n
        held = {b for h in self.holders for b in h}
        assert not held & set(got), "allocation took a block that is still held"
        for b in got:
            assert self.pool.refcount(b) == 1
            # A reused block's old content must be gone from the index.
            self.registered = {h: x for h, x in self.registered.items() if x != b}
        self.holders.append(got)

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        held = self.holders.pop(i % len(self.holders))
        self.pool.release(reversed(held))

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def register(self, i, j):
        held = self.holders[i % len(self.holders)]
        if not held:
            return
        b = held[j % len(held)]
        self.counter += 1
        h = hash_block(root_hash(), [self.counter])
        if self.pool.register(b, h):
            self.registered[h] = b

    @precondition(lambda self: self.registered)
    @rule(i=st.integers(0, 100))
    def acquire_cached(self, i):
        h = sorted(self.registered)[i % len(self.registered)]
        b = self.pool.lookup(h)
        assert b == self.registered[h]
        self.pool.acquire([b])
        self.holders.append([b])

    @invariant()
    def refcounts_equal_holders(self):
        counts = Counter(b for held in self.holders for b in held)
        for b in range(self.pool.num_blocks):
            assert self.pool.refcount(b) == counts.get(b, 0)
        assert self.pool.num_free_blocks == self.pool.num_blocks - len(counts)

    @invariant()
    def index_matches_model(self):
        for h, b in self.registered.items():
            assert self.pool.lookup(h) == b
        assert self.pool.num_cached_blocks == len(self.registered)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
