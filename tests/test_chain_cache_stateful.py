"""A hypothesis state machine over the real engine (tiny random Llama, dense, a small pool): turns on
chains, forks run side by side, drops, memory pressure from plain requests, pruning and busy writers.

Dense KV is exact, so every turn on an undegraded chain must equal a full recompute of its prompt by
a separate engine without any cache: a fork that saw another's blocks, a stale copy or a wrong
position would change tokens. Pruned (degraded) chains are compared fork against fork. After every
rule each block's refcount equals the chains holding it, and the chain records match the model."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparse_cache import ChainBusyError, ChainCapacityError
from sparse_serve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
IDS = ["a", "b", "c", "d"]
_MODEL: dict = {}


@pytest.fixture(autouse=True)
def _setup(tiny_checkpoint):
    _MODEL["path"] = str(tiny_checkpoint("llama")[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread beats contending for a loaded box
    yield
    torch.set_num_threads(threads)


def _llm(**kw) -> LLM:
    base = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    return LLM(_MODEL["path"], **{**base, **kw})


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class EngineChainMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.llm = _llm(num_kv_blocks=40)
        self.engine = self.llm.engine
        self.engine.kv.chains.max_chains = 3
        self.reference = _llm(enable_prefix_caching=False)
        self.chains: dict[str, dict] = {}  # id -> history, processed, has_kv, degraded
        self.next_id = 0

    # -- helpers --------------------------------------------------------------------------------
    def _sync(self):
        """Idle chains may lose their KV (pressure) or their record (capacity) to any allocation."""
        for cid in list(self.chains):
            if cid not in self.engine.kv.chains:
                del self.chains[cid]
            elif not self.engine.chain_info(cid).kv_lens:
                self.chains[cid]["has_kv"] = False

    def _prompt(self, cid: str, n: int, seed: int) -> list[int]:
        model = self.chains.get(cid)
        return (model["history"] if model else _tokens(20, seed + 1000)) + _tokens(n, seed)

    def _check_turn(self, cid: str, prompt: list[int], out) -> None:
        model = self.chains.get(cid)
        expected = "created" if model is None else "resumed" if model["has_kv"] else "recreated"
        assert out.chain_status == expected
        assert out.reused_tokens == (model["processed"] if expected == "resumed" else 0)
        degraded = expected == "resumed" and model["degraded"]
        if not degraded:
            assert out.token_ids == self.reference.generate(prompt, GREEDY)[0].token_ids
        history = prompt + list(out.token_ids)
        self.chains[cid] = {"history": history, "processed": len(history) - 1, "has_kv": True, "degraded": degraded}

    def _room_for(self, n: int) -> bool:
        return len(self.chains) + n <= self.engine.kv.chains.max_chains

    def _fits(self, *prompts: list[int]) -> bool:
        return all(len(p) + GREEDY.max_tokens < self.engine.max_model_len - 8 for p in prompts)

    # -- rules ----------------------------------------------------------------------------------
    @initialize(n=st.integers(20, 60), seed=st.integers(0, 10**6))
    def first_chain(self, n, seed):
        self.turn("a", n, seed)

    def _pick(self, i: int) -> str:
        """An existing chain (pruned ones included) for most draws, else one of the plain ids."""
        known = sorted(self.chains)
        return known[i % len(known)] if known and i % 4 else IDS[i % len(IDS)]

    @rule(i=st.integers(0, 99), n=st.integers(1, 30), seed=st.integers(0, 10**6))
    def turn_on(self, i, n, seed):
        self.turn(self._pick(i), n, seed)

    def turn(self, cid, n, seed):
        prompt = self._prompt(cid, n, seed)
        if not self._fits(prompt):
            self.drop(cid)
            return
        out = self.llm.generate(prompt, GREEDY, chain_id=cid)[0]
        self._check_turn(cid, prompt, out)
        self._sync()

    @rule(i=st.integers(0, 99), n=st.integers(1, 20), seed=st.integers(0, 10**6), same=st.booleans())
    def fork_and_run_both(self, i, n, seed, same):
        cid = self._pick(i)
        model = self.chains.get(cid)
        if model is None:
            return
        prompts = [self._prompt(cid, n, seed), self._prompt(cid, n, seed if same else seed + 1)]
        if not self._fits(*prompts):
            return
        fork = self.llm.fork_chain(cid, f"f{self.next_id}")  # named: the model's chain order stays reproducible
        self.next_id += 1
        self.chains[fork] = {**model}
        self._sync()  # at capacity, forking forgot the least recently used other idle chain
        outs = self.llm.generate(prompts, GREEDY, chain_id=[cid, fork])
        if same:
            assert outs[0].token_ids == outs[1].token_ids
        for c, p, o in zip([cid, fork], prompts, outs, strict=True):
            self._check_turn(c, p, o)
        self._sync()

    @rule(i=st.integers(0, 99))
    def drop_one(self, i):
        self.drop(self._pick(i))

    def drop(self, cid):
        if cid in self.chains:
            self.llm.drop_chain(cid)
            del self.chains[cid]

    @rule(n=st.integers(60, 200), seed=st.integers(0, 10**6))
    def pressure(self, n, seed):
        preemptions = self.engine.scheduler.num_preemptions
        self.llm.generate(_tokens(n, seed), GREEDY)
        assert self.engine.scheduler.num_preemptions == preemptions  # idle chains went first
        self._sync()

    @precondition(lambda self: self.chains)
    @rule(i=st.integers(0, 99), a=st.integers(0, 60), length=st.integers(1, 20), keep=st.integers(0, 6))
    def prune(self, i, a, length, keep):
        cid = sorted(self.chains)[i % len(self.chains)]
        history = self.chains[cid]["history"][: self.chains[cid]["processed"]]
        cached = self.engine.kv.cached_prefix(history).num_tokens
        if cached < 2 or self.chains[cid]["degraded"]:
            return
        start = a % (cached - 1)
        end = min(cached, start + length)
        if end >= len(history):
            return
        new = f"p{self.next_id}"
        self.next_id += 1
        try:
            result = self.llm.prune(history, [(start, end)], keep_tokens=keep, observation_window_size=4, chain_id=new)
        except ValueError as e:  # everything after the range is copied: an early range may not fit now
            assert "free KV blocks" in str(e)
            self._sync()
            return
        dropped = end - start - len(result.kept[0])
        assert result.num_tokens == cached and result.num_retained_tokens == cached - dropped
        self.chains[new] = {"history": history[:cached], "processed": cached, "has_kv": True, "degraded": True}
        self._sync()

    @precondition(lambda self: self.chains)
    @rule(i=st.integers(0, 99))
    def second_writer_is_refused(self, i):
        cid = sorted(self.chains)[i % len(self.chains)]
        model = self.chains[cid]
        rid = self.engine.add_request(model["history"] + [5], GREEDY, chain_id=cid)
        with pytest.raises(ChainBusyError):
            self.engine.add_request(model["history"] + [6], GREEDY, chain_id=cid)
        with pytest.raises(ChainBusyError):
            self.llm.fork_chain(cid)
        self.engine.abort_request(rid)  # the chain gets its history back, and the refused token appended
        model["history"] = model["history"] + [5]
        if not model["has_kv"]:  # checked out without KV: to be recomputed, so no longer degraded
            model["processed"] = 0
            model["degraded"] = False

    @rule()
    def capacity(self):
        if self._room_for(1):
            return
        busy = sorted(self.chains)
        rids = [self.engine.add_request(self.chains[c]["history"] + [5], GREEDY, chain_id=c) for c in busy]
        with pytest.raises(ChainCapacityError):
            self.engine.add_request([1, 2, 3], GREEDY, chain_id="new")
        for rid, c in zip(rids, busy, strict=True):
            self.engine.abort_request(rid)
            model = self.chains[c]
            model["history"] = model["history"] + [5]
            if not model["has_kv"]:  # as in second_writer_is_refused
                model["processed"] = 0
                model["degraded"] = False

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def blocks_are_held_by_chains_only(self):
        kv = self.engine.kv
        held = Counter(b for t in kv.chains.held_tables().values() for b in t.block_ids)
        assert all(kv.pool.refcount(b) == held.get(b, 0) for b in range(kv.num_blocks))
        assert kv.pool.num_used_blocks == len(held) and not self.engine.has_unfinished_requests()

    @invariant()
    def records_match_the_model(self):
        assert set(self.engine.kv.chains) == set(self.chains)
        for cid, model in self.chains.items():
            info = self.engine.chain_info(cid)
            assert not info.busy and info.degraded == model["degraded"]
            assert info.num_tokens == model["processed"] and bool(info.kv_lens) == model["has_kv"]
            assert list(self.engine.kv.chains.history(cid)) == model["history"]


TestEngineChainMachine = EngineChainMachine.TestCase
TestEngineChainMachine.settings = settings(max_examples=15, stateful_step_count=10, deadline=None)
