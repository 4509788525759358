"""KV cache manager: prefix hits, None on shortage, and a stateful test of the whole lifecycle."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparse_cache import KVCacheManager


def test_prefix_hit_shares_blocks_and_counts_tokens():
    m = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(10))
    assert m.match_prefix(prompt).num_tokens == 0
    assert m.allocate("a", len(prompt)) is not None
    m.cache_blocks("a", prompt, num_computed_tokens=10)
    hit = m.match_prefix(prompt + [99, 98])
    assert hit.num_tokens == 8 and hit.block_ids == tuple(m.table("a").block_ids[:2])
    assert m.allocate("b", 12, prefix=hit) == [m.table("b").block_ids[2]]
    assert m.prefix_hit_tokens == 8
    assert m.pool.refcount(m.table("a").block_ids[0]) == 2


def test_match_leaves_the_last_token_to_compute():
    m = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(8))
    m.allocate("a", 8)
    m.cache_blocks("a", prompt, 8)
    assert m.match_prefix(prompt).num_tokens == 4


def test_salt_separates_caches():
    prompt = list(range(8))
    m = KVCacheManager(num_blocks=4, block_size=4, salt=b"model-a")
    m.allocate("a", 8)
    m.cache_blocks("a", prompt, 8)
    m.salt = b"model-b"
    assert m.match_prefix(prompt + [1]).num_tokens == 0


def test_allocate_none_changes_nothing():
    m = KVCacheManager(num_blocks=3, block_size=2)
    assert m.allocate("a", 4) is not None
    assert m.allocate("b", 4) is None
    assert not m.has_request("b") and m.num_free_blocks == 1
    assert m.allocate("a", 6) is not None and m.num_free_blocks == 0


def test_free_then_hit_after_reuse_of_free_cached_blocks():
    m = KVCacheManager(num_blocks=2, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    m.allocate("a", 4)
    m.cache_blocks("a", prompt, 4)
    m.free("a")
    hit = m.match_prefix(prompt)
    assert hit.num_tokens == 4
    # Revived blocks take free capacity: 2 cached + 1 new does not fit in 2 blocks.
    assert m.allocate("b", 5, prefix=hit) is None
    assert m.allocate("b", 4, prefix=hit) == []


def test_disabled_prefix_cache_never_matches():
    m = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    m.allocate("a", 4)
    m.cache_blocks("a", [1, 2, 3, 4], 4)
    assert m.match_prefix([1, 2, 3, 4, 5]).num_tokens == 0


class ManagerMachine(RuleBasedStateMachine):
    """Requests over a small vocabulary (so prefixes collide); the pool never leaks or double-owns."""

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(num_blocks=12, block_size=2)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def start(self, prompt):
        rid = self.next_id
        self.next_id += 1
        hit = self.m.match_prefix(prompt)
        assert hit.num_tokens < len(prompt)
        free_before = self.m.num_free_blocks
        got = self.m.allocate(rid, len(prompt), prefix=hit)
        if got is None:
            assert self.m.num_free_blocks == free_before and not self.m.has_request(rid)
            return
        self.tokens[rid] = list(prompt)
        self.computed[rid] = len(prompt)
        self.m.cache_blocks(rid, prompt, len(prompt))

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 2))
    def extend(self, i, tok):
        rid = sorted(self.tokens)[i % len(self.tokens)]
        toks = self.tokens[rid] + [tok]
        if self.m.allocate(rid, len(toks)) is None:
            return
        self.tokens[rid] = toks
        self.m.cache_blocks(rid, toks, len(toks))

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        rid = sorted(self.tokens)[i % len(self.tokens)]
        self.m.free(rid)
        del self.tokens[rid]

    @invariant()
    def no_leak_no_double_owner(self):
        holders = Counter()
        for rid, toks in self.tokens.items():
            table = self.m.table(rid)
            assert len(table.block_ids) == -(-len(toks) // 2)
            assert len(set(table.block_ids)) == len(table.block_ids)
            holders.update(table.block_ids)
        for b in range(self.m.num_blocks):
            assert self.m.pool.refcount(b) == holders.get(b, 0)
        assert self.m.num_free_blocks == self.m.num_blocks - len(holders)

    @invariant()
    def shared_blocks_hold_equal_tokens(self):
        # Two requests may share a block only if their tokens up to and including it are equal.
        owner: dict[int, tuple[int, list[int]]] = {}
        for rid, toks in self.tokens.items():
            for k, b in enumerate(self.m.table(rid).block_ids):
                prefix = toks[: (k + 1) * 2]
                if b in owner:
                    k0, other = owner[b]
                    assert k0 == k and other == prefix
                else:
                    owner[b] = (k, prefix)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
