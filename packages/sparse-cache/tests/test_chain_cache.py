"""Chain cache: errors where specified, and state machines over create / resume / fork / finish /
evict / prune (/ compact) against a fake KV store, so copy-on-write is checked slot by slot."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparse_cache import (
    BlockPool,
    BlockTable,
    ChainBusyError,
    ChainCache,
    ChainCapacityError,
    ChainExistsError,
    ChainFingerprintError,
    ChainPrefixMismatchError,
    ChainStatus,
    KVCacheManager,
    PruneRange,
    UnknownChainError,
    hash_full_blocks,
    plan_prune,
)


def _table(pool: BlockPool, n_blocks: int, num_tokens: int, bs: int = 2) -> BlockTable:
    return BlockTable(bs, pool.allocate(n_blocks), num_tokens)


def test_statuses_and_errors():
    pool = BlockPool(8)
    c = ChainCache(pool, max_chains=2)
    assert c.checkout("a", [1, 2, 3], b"fp", owner="r1").status is ChainStatus.CREATED
    with pytest.raises(ChainBusyError):
        c.checkout("a", [1, 2, 3, 4], b"fp", owner="r2")
    with pytest.raises(ChainBusyError):
        c.fork("a")
    c.checkin("a", "r1", [1, 2, 3], _table(pool, 2, 3), [3, 3], state="s")
    with pytest.raises(ChainPrefixMismatchError, match="differs at token 1"):
        c.checkout("a", [1, 9, 3, 4], b"fp", owner="r2")
    with pytest.raises(ChainPrefixMismatchError, match="at least one token"):
        c.checkout("a", [1, 2, 3], b"fp", owner="r2")
    with pytest.raises(ChainFingerprintError):
        c.checkout("a", [1, 2, 3, 4], b"other", owner="r2")
    with pytest.raises(UnknownChainError):
        c.checkout("b", [1], b"fp", owner="r2", create=False)
    with pytest.raises(UnknownChainError):
        c.fork("nope")
    co = c.checkout("a", [1, 2, 3, 4], b"fp", owner="r2")
    assert co.status is ChainStatus.RESUMED and co.num_reused_tokens == 3 and co.state == "s"
    assert co.kv_lens == (3, 3) and pool.refcount(co.table.block_ids[0]) == 1
    # Record capacity: a busy chain is pinned; creating a second fills the cache, a third cannot fit.
    assert c.checkout("b", [5], b"fp", owner="r3").status is ChainStatus.CREATED
    with pytest.raises(ChainCapacityError):
        c.checkout("c", [5], b"fp", owner="r4")
    c.checkin("b", "r3", [5], None)
    assert c.checkout("c", [5], b"fp", owner="r4").status is ChainStatus.CREATED  # forgot idle "b"
    assert "b" not in c and "a" in c
    c.checkin("a", "r2", [1, 2, 3, 4], co.table, [4, 4])
    with pytest.raises(ChainExistsError):
        c.fork("a", "c")


def test_evicted_chain_keeps_tokens_and_is_recreated():
    pool = BlockPool(4)
    c = ChainCache(pool)
    c.checkout("a", [1, 2, 3], b"", owner=1)
    c.checkin("a", 1, [1, 2, 3], _table(pool, 2, 3), [3], pending=[4])
    assert c.token_ids("a") == (1, 2, 3) and c.history("a") == (1, 2, 3, 4)
    assert c.num_reclaimable_blocks() == 2
    assert not c.reclaim(5) and c.info("a").num_blocks == 2  # hopeless: evicts nothing
    assert c.reclaim(4) and pool.num_free_blocks == 4 and c.num_kv_evictions == 1
    assert c.history(c.fork("a")) == c.history("a") == (1, 2, 3, 4)
    with pytest.raises(ChainPrefixMismatchError):
        c.checkout("a", [1, 2], b"", owner=2)
    co = c.checkout("a", [1, 2, 3, 7], b"", owner=2)
    assert co.status is ChainStatus.RECREATED and co.num_reused_tokens == 0 and co.table is None


def test_fork_shares_blocks_and_forked_blocks_are_not_reclaimable_alone():
    pool = BlockPool(4)
    c = ChainCache(pool)
    c.checkout("a", [1, 2, 3], b"", owner=1)
    c.checkin("a", 1, [1, 2, 3], _table(pool, 2, 3), [3])
    f = c.fork("a")
    assert all(pool.refcount(b) == 2 for b in c.held_tables()[f].block_ids)
    assert c.num_reclaimable_blocks() == 2
    c.drop("a")
    assert pool.num_free_blocks == 2 and c.num_reclaimable_blocks() == 2
    c.drop(f)
    assert pool.num_free_blocks == 4


def test_plan_prune_shares_unchanged_blocks():
    plan = plan_prune(12, [PruneRange(5, 9)], [[6, 8]], block_size=4)
    assert plan.retained == (0, 1, 2, 3, 4, 6, 8, 9, 10, 11)
    assert plan.num_shared_blocks == 1 and plan.copied_positions() == (4, 6, 8, 9, 10, 11)
    with pytest.raises(ValueError, match="inside"):
        plan_prune(12, [PruneRange(5, 9)], [[4]], block_size=4)
    with pytest.raises(ValueError, match="overlaps"):
        plan_prune(12, [(1, 4), (3, 6)], [[], []], block_size=4)


def test_write_into_a_shared_block_copies_it_first():
    m = KVCacheManager(8, 2, enable_prefix_caching=False)
    m.resume_chain("r1", "a", [1, 2, 3])
    m.allocate("r1", 3)
    m.save_chain("r1", "a", [1, 2, 3], [3])
    f = m.chains.fork("a")
    co = m.resume_chain("r2", f, [1, 2, 3, 4])
    shared = list(co.table.block_ids)
    assert m.allocate("r2", 4, write_from=3) == []
    (copy,) = m.take_copies()
    assert copy == (shared[1], m.table("r2").block_ids[1]) and m.table("r2").block_ids[0] == shared[0]
    assert m.pool.refcount(shared[1]) == 1 and m.pool.refcount(shared[0]) == 2


def test_a_resumed_pruned_chain_never_enters_the_radix_index():
    m = KVCacheManager(16, 2, salt=b"s")
    history = [1, 2, 3, 4, 5, 6, 7, 8]
    m.allocate("a", 8)
    m.cache_blocks("a", history, 8)
    match = m.cached_prefix(history)
    plan = plan_prune(8, [PruneRange(2, 6)], [[3, 5]], block_size=2)
    cid, copies = m.add_pruned_chain(None, history, match, plan, num_layers=1)
    assert [s for s, _ in copies] == [3, 5, 6, 7] and m.chains.info(cid).degraded
    m.free("a")
    m.reset_prefix_cache()  # the exact blocks are forgotten: nothing shadows the pruned ones any more
    co = m.resume_chain("b", cid, [*history, 9])
    assert co.status is ChainStatus.RESUMED and co.num_reused_tokens == 8 and co.kv_lens == (6,)
    m.allocate("b", 7, write_from=6)
    m.cache_blocks("b", [*history, 9], 9)
    assert all(m.pool.block_hash(b) is None for b in m.table("b").block_ids[1:])
    assert m.cached_prefix(history).num_tokens == 2  # only the shared, unchanged first block


BS = 2
SLOTS = ["c0", "c1", "c2", "c3"]


class ChainMachine(RuleBasedStateMachine):
    """Requests on chains over a tiny pool. The fake KV maps each slot to (position, token); every
    holder (request or idle chain) must read through its table exactly the KV it expects, so a fork
    that saw another's write, a leaked or doubly owned block, or a degraded block in the radix index
    fails an invariant. ``radix`` mirrors exact methods (prefix caching, pruning, no compaction);
    otherwise eviction methods (no prefix caching, compaction)."""

    radix = False

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(12, BS, enable_prefix_caching=self.radix, salt=b"s", max_chains=3)
        self.kv: dict[int, list] = {}
        self.reqs: dict[int, dict] = {}  # rid -> chain, tokens (processed), exp (slot contents) or None (lost)
        self.chains: dict[str, dict] = {}  # cid -> tokens, exp (None: no KV), owner
        self.hashed: dict[bytes, tuple] = {}
        self.histories: list[list[int]] = []
        self.next_id = 0

    # -- fake KV ------------------------------------------------------------------------------
    def _read(self, table, n):
        return [self.kv.get(table.block_ids[i // BS], [None] * BS)[i % BS] for i in range(n)]

    def _write(self, table, slot, content):
        self.kv.setdefault(table.block_ids[slot // BS], [None] * BS)[slot % BS] = content

    def _apply_copies(self):
        copies = self.m.take_copies()
        sources = [list(self.kv.get(s, [None] * BS)) for s, _ in copies]  # every source read first
        for (_, d), content in zip(copies, sources, strict=True):
            self.kv[d] = content

    def _sync(self):
        """Chains the cache evicted (KV under pressure, records at capacity) must have been idle."""
        for cid in list(self.chains):
            model = self.chains[cid]
            if cid not in self.m.chains:
                assert model["owner"] is None
                del self.chains[cid]
            elif model["exp"] is not None and cid not in self.m.chains.held_tables():
                assert model["owner"] is None
                model["exp"] = None

    def _record_hashes(self, tokens):
        for k, h in enumerate(hash_full_blocks(tokens, BS, b"s")):
            self.hashed[h] = tuple((k * BS + i, tokens[k * BS + i]) for i in range(BS))

    def _lose(self, rid):
        if self.m.has_request(rid):
            self.m.free(rid)
        self.reqs[rid]["exp"] = None

    def _process(self, rid, toks):
        req = self.reqs[rid]
        kv_len = len(req["exp"])
        if self.m.allocate(rid, kv_len + len(toks), write_from=kv_len) is None:
            self._lose(rid)  # the engine would preempt it
            self._sync()
            return
        self._sync()
        self._apply_copies()
        table = self.m.table(rid)
        for i, t in enumerate(toks):
            content = (len(req["tokens"]), t)
            self._write(table, kv_len + i, content)
            req["exp"].append(content)
            req["tokens"].append(t)
        if self.radix:
            self.m.cache_blocks(rid, req["tokens"], len(req["tokens"]))
            self._record_hashes(req["tokens"])

    def _idle_others(self, keep=None):
        return any(c["owner"] is None for cid, c in self.chains.items() if cid != keep)

    # -- rules --------------------------------------------------------------------------------
    @initialize(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=7))
    def first_turn(self, prompt):
        self.start("c0", prompt, False)
        self.finish(0)

    @rule(c=st.sampled_from(SLOTS), ext=st.lists(st.integers(0, 2), min_size=1, max_size=5), bad=st.booleans())
    def start(self, c, ext, bad):
        rid, self.next_id = self.next_id, self.next_id + 1
        model = self.chains.get(c)
        base = list(model["tokens"]) if model else []
        prompt = ([(base[0] + 1) % 3, *base[1:]] if bad and base else base) + ext
        if model is None and len(self.chains) >= self.m.chains.max_chains and not self._idle_others():
            with pytest.raises(ChainCapacityError):
                self.m.resume_chain(rid, c, prompt)
            return
        if model is not None and model["owner"] is not None:
            with pytest.raises(ChainBusyError):
                self.m.resume_chain(rid, c, prompt)
            return
        if bad and base:
            with pytest.raises(ChainPrefixMismatchError):
                self.m.resume_chain(rid, c, prompt)
            return
        co = self.m.resume_chain(rid, c, prompt)
        self.chains[c] = {"tokens": base, "exp": None, "owner": rid, "state": None}
        self._sync()
        expected = ChainStatus.CREATED if model is None else ChainStatus.RESUMED
        if model is not None and model["exp"] is None:
            expected = ChainStatus.RECREATED
        assert co.status is expected
        resumed = co.status is ChainStatus.RESUMED
        assert co.token_ids == (tuple(base) if resumed else ())
        exp = list(model["exp"]) if resumed else []
        self.reqs[rid] = {"chain": c, "tokens": list(co.token_ids), "exp": exp}
        if resumed:
            assert co.state == model["state"]
        elif self.radix:  # a fresh start maps the radix cache's prefix, as the engine's admission does
            hit = self.m.match_prefix(prompt)
            if self.m.allocate(rid, hit.num_tokens, prefix=hit) is None:
                self._lose(rid)
                return
            self.reqs[rid]["tokens"] = prompt[: hit.num_tokens]
            self.reqs[rid]["exp"] = [(p, prompt[p]) for p in range(hit.num_tokens)]
        self._process(rid, prompt[len(self.reqs[rid]["tokens"]) :])

    def _live(self):
        return sorted(r for r, q in self.reqs.items() if q["exp"] is not None)

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 99), tok=st.integers(0, 2))
    def append(self, i, tok):
        live = self._live()
        self._process(live[i % len(live)], [tok])

    @precondition(lambda self: not self.radix and self._live())
    @rule(i=st.integers(0, 99), keep=st.lists(st.booleans(), max_size=16))
    def compact(self, i, keep):
        live = self._live()
        rid = live[i % len(live)]
        req = self.reqs[rid]
        kept = [k for k, flag in enumerate(keep[: len(req["exp"])]) if flag]
        moved = [i for i, k in enumerate(kept) if i != k]
        if moved and not self.m.make_exclusive(rid, moved[0] // BS, -(-len(kept) // BS)):
            self._lose(rid)
            return
        self._sync()
        self._apply_copies()
        table = self.m.table(rid)
        old = self._read(table, len(req["exp"]))
        for i, k in enumerate(kept):
            self._write(table, i, old[k])
        req["exp"] = [req["exp"][k] for k in kept]
        self.m.shrink(rid, len(kept))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def finish(self, i):
        rid = sorted(self.reqs)[i % len(self.reqs)]
        req = self.reqs.pop(rid)
        lost = req["exp"] is None
        tokens = [] if lost else req["tokens"]
        kv_lens = [] if lost else [len(req["exp"])]
        self.m.save_chain(rid, req["chain"], tokens, kv_lens, state=("state", tuple(tokens)))
        has_kv = not lost and bool(tokens) and bool(req["exp"])
        self.chains[req["chain"]] = {
            "tokens": tokens,
            "exp": req["exp"] if has_kv else None,
            "owner": None,
            "state": ("state", tuple(tokens)) if has_kv else None,
        }
        if self.radix and tokens:
            self.histories.append(tokens)

    @rule(c=st.sampled_from(SLOTS), new=st.sampled_from([None, *SLOTS]))
    def fork(self, c, new):
        model = self.chains.get(c)
        errors = [
            (model is None, UnknownChainError),
            (model is not None and model["owner"] is not None, ChainBusyError),
            (new in self.chains, ChainExistsError),
            (len(self.chains) >= self.m.chains.max_chains and not self._idle_others(keep=c), ChainCapacityError),
        ]
        error = next((e for cond, e in errors if cond), None)
        if error is not None:
            with pytest.raises(error):
                self.m.chains.fork(c, new)
            return
        new = self.m.chains.fork(c, new)
        self._sync()
        self.chains[new] = {**model, "tokens": list(model["tokens"])}

    @rule(
        c=st.sampled_from(SLOTS),
        ext1=st.lists(st.integers(0, 2), min_size=1, max_size=3),
        ext2=st.lists(st.integers(0, 2), min_size=1, max_size=3),
    )
    def fork_and_resume_both(self, c, ext1, ext2):
        """Both branches of a fork write at once: the usual way into copy-on-write."""
        model = self.chains.get(c)
        if model is None or model["owner"] is not None or model["exp"] is None:
            return
        try:
            new = self.m.chains.fork(c)
        except ChainCapacityError:
            return
        self._sync()
        self.chains[new] = {**model, "tokens": list(model["tokens"])}
        self.start(c, ext1, False)
        self.start(new, ext2, False)

    @rule(c=st.sampled_from(SLOTS))
    def drop(self, c):
        model = self.chains.get(c)
        if model is None or model["owner"] is not None:
            with pytest.raises(UnknownChainError if model is None else ChainBusyError):
                self.m.chains.drop(c)
            return
        self.m.chains.drop(c)
        del self.chains[c]

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        reachable = self.m.num_available_blocks >= n
        assert self.m.chains.reclaim(n) == reachable
        self._sync()

    @precondition(lambda self: self.radix)
    @rule()
    def forget_radix_cache(self):
        self.m.reset_prefix_cache()  # exact copies gone: only a leak of degraded KV could fill the index now

    @precondition(lambda self: self.radix and self.histories)
    @rule(i=st.integers(0, 99), a=st.integers(0, 20), b=st.integers(1, 6), keep=st.lists(st.booleans(), max_size=6))
    def prune(self, i, a, b, keep):
        tokens = self.histories[i % len(self.histories)]
        match = self.m.cached_prefix(tokens)
        if match.num_tokens < 2:
            return
        start = a % (match.num_tokens - 1)
        rng = PruneRange(start, min(match.num_tokens, start + b))
        kept = [rng.start + k for k, flag in enumerate(keep[: len(rng)]) if flag]
        plan = plan_prune(match.num_tokens, [rng], [kept], BS)
        self.m.pool.acquire(match.block_ids)  # the engine pins the history while it scores
        source = BlockTable(BS, list(match.block_ids), match.num_tokens)
        history = self._read(source, match.num_tokens)
        try:
            if len(self.chains) >= self.m.chains.max_chains and not self._idle_others():
                with pytest.raises(ChainCapacityError):  # checked before any block is taken
                    self.m.add_pruned_chain(None, tokens, match, plan, 1)
                return
            try:
                cid, copies = self.m.add_pruned_chain(None, tokens, match, plan, 1)
            except ValueError as e:  # the pool is too full for the copies
                assert "free KV blocks" in str(e)
                return
            self._sync()
            for src, dst in copies:
                self.kv.setdefault(dst // BS, [None] * BS)[dst % BS] = self.kv[src // BS][src % BS]
            exp = [history[p] for p in plan.retained]
            self.chains[cid] = {"tokens": tokens[: match.num_tokens], "exp": exp, "owner": None, "state": None}
            assert self.m.chains.info(cid).degraded
        finally:
            self.m.pool.release(reversed(match.block_ids))
            self._sync()

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def refcounts_equal_holders(self):
        holders = Counter()
        for rid, req in self.reqs.items():
            if req["exp"] is not None:
                ids = self.m.table(rid).block_ids
                assert len(set(ids)) == len(ids) == -(-len(req["exp"]) // BS)
                holders.update(ids)
            else:
                assert not self.m.has_request(rid)
        tables = self.m.chains.held_tables()
        assert set(tables) == {c for c, m in self.chains.items() if m["exp"] is not None}
        for table in tables.values():
            holders.update(table.block_ids)
        for b in range(self.m.num_blocks):
            assert self.m.pool.refcount(b) == holders.get(b, 0)
        assert self.m.num_free_blocks == self.m.num_blocks - len(holders)

    @invariant()
    def every_holder_reads_its_own_kv(self):
        for rid, req in self.reqs.items():
            if req["exp"] is not None:
                assert self._read(self.m.table(rid), len(req["exp"])) == req["exp"]
        for cid, table in self.m.chains.held_tables().items():
            model = self.chains[cid]
            assert self._read(table, len(model["exp"])) == model["exp"]
            assert self.m.chains.info(cid).kv_lens == (len(model["exp"]),)
            assert list(self.m.chains.token_ids(cid)) == list(model["tokens"])

    @invariant()
    def radix_index_holds_only_exact_blocks(self):
        for b in range(self.m.num_blocks):
            h = self.m.pool.block_hash(b)
            if h is not None:
                assert tuple(self.kv[b]) == self.hashed[h]

    @invariant()
    def no_pending_copies(self):
        assert not self.m.take_copies()


class RadixChainMachine(ChainMachine):
    radix = True


TestChainMachine = ChainMachine.TestCase
TestChainMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestRadixChainMachine = RadixChainMachine.TestCase
TestRadixChainMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
