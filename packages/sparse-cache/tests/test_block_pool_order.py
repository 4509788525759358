"""The pool's bulk free list hands blocks out in exactly the order of a plain one-list model.

The model keeps the free list as one Python list in eviction order (first = reused first): a block
freed with no cached content goes to the front, a cached one to the back; ``reset_prefix_cache`` moves
each free block to the front in turn. A block released twice in one call becomes free at its last listing.
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparse_cache import BlockPool, hash_block, root_hash


class ModelPool:
    def __init__(self, n: int):
        self.refcount = [0] * n
        self.free = list(range(n))
        self.cached: set[int] = set()

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        for b in got:
            self.refcount[b] = 1
            self.cached.discard(b)
        return got

    def release(self, ids: list[int]) -> None:
        for b in ids:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self.free = self.free + [b] if b in self.cached else [b] + self.free

    def acquire(self, ids: list[int]) -> None:
        for b in ids:
            if self.refcount[b] == 0:
                self.free.remove(b)
            self.refcount[b] += 1

    def reset(self) -> None:
        self.cached -= set(self.free)  # held blocks keep their content
        for b in list(self.free):
            self.free.remove(b)
            self.free.insert(0, b)


class OrderMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool, self.model = BlockPool(10), ModelPool(10)
        self.held: list[int] = []  # one entry per holder reference
        self.counter = 0

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        got = self.pool.allocate(n)
        assert got == self.model.allocate(n)
        self.held += got or []

    @precondition(lambda self: self.held)
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=6))
    def release(self, picks):
        counts = Counter(self.held)
        ids = []
        for p in picks:  # any multiset of held references, duplicates included
            if counts:
                b = sorted(counts)[p % len(counts)]
                ids.append(b)
                counts[b] -= 1
                counts += Counter()  # drop zeros
        for b in ids:
            self.held.remove(b)
        self.pool.release(ids)
        self.model.release(ids)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def register(self, i):
        b = self.held[i % len(self.held)]
        self.counter += 1
        if self.pool.register(b, hash_block(root_hash(), [self.counter])):
            self.model.cached.add(b)

    @precondition(lambda self: self.model.cached)
    @rule(i=st.integers(0, 100), twice=st.booleans())
    def acquire(self, i, twice):
        b = sorted(self.model.cached)[i % len(self.model.cached)]
        ids = [b, b] if twice else [b]
        self.pool.acquire(ids)
        self.model.acquire(ids)
        self.held += ids

    @rule()
    def reset(self):
        self.pool.reset_prefix_cache()
        self.model.reset()

    @invariant()
    def same_state(self):
        assert self.pool.num_free_blocks == len(self.model.free)
        assert [self.pool.refcount(b) for b in range(10)] == self.model.refcount
        assert self.pool.num_cached_blocks == len(self.model.cached)
        assert self.pool.num_shared_blocks == sum(c > 1 for c in self.model.refcount)
        assert self.pool.any_shared(range(10)) == any(c > 1 for c in self.model.refcount)


def test_free_order_after_mixed_releases():
    pool = BlockPool(6)
    a = pool.allocate(6)
    pool.register(a[0], hash_block(root_hash(), [1]))
    pool.register(a[1], hash_block(root_hash(), [2]))
    pool.release([a[2], a[0], a[3], a[1]])
    assert pool.allocate(4) == [a[3], a[2], a[0], a[1]]


TestOrderMachine = OrderMachine.TestCase
TestOrderMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
