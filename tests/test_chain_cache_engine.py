"""Chains end to end on CPU (tiny random Llama): a resumed chain equals one uninterrupted session and
prefills only the suffix; forks continue independently (copy-on-write) and free everything; errors
where specified; idle chains give their KV back under memory pressure before anything is preempted."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from sparse_cache import (
    ChainBusyError,
    ChainCapacityError,
    ChainFingerprintError,
    ChainPrefixMismatchError,
    UnknownChainError,
)
from sparse_serve import LLM, SamplingParams

BLOCK = 8
METHODS = {
    "dense": {},
    "streamingllm": dict(
        sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=36, decode_eviction_interval=4
    ),
    "snapkv": dict(
        sparse_method="snapkv",
        sink_keep_tokens=4,
        decode_keep_tokens=20,
        recent_keep_tokens=16,
        observation_window_size=8,
        decode_eviction_interval=3,
    ),
    "pyramidkv": dict(
        sparse_method="pyramidkv",
        sink_keep_tokens=4,
        decode_keep_tokens=36,
        recent_keep_tokens=8,
        observation_window_size=8,
        pyramidkv_beta=2.0,
        decode_eviction_interval=3,
    ),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=40, h2o_decode_budget=24, decode_eviction_interval=3),
    "adakv": dict(  # a head-major store: the chain keeps a table per (layer, KV head), ragged after turn 1
        sparse_method="adakv",
        sink_keep_tokens=4,
        decode_keep_tokens=20,
        recent_keep_tokens=16,
        observation_window_size=8,
    ),
    "tova": dict(sparse_method="tova", decode_keep_tokens=35, decode_eviction_interval=2),
    "rkv": dict(
        sparse_method="rkv",
        sink_keep_tokens=0,
        decode_keep_tokens=32,
        recent_keep_tokens=8,
        rkv_compression_interval=3,
        rkv_observation_tokens=3,
    ),
    "skipkv": dict(
        sparse_method="skipkv",
        sink_keep_tokens=4,
        decode_keep_tokens=28,
        recent_keep_tokens=8,
        skipkv_compression_interval=3,
        skipkv_redundancy_window=8,
        skipkv_segment_size=4,
    ),
}
# Over KIVI (pages of 16, the store's smallest) the chain carries the incomplete page's full-precision tail.
METHODS["kivi"] = dict(kv_cache_dtype="kivi", block_size=16)
METHODS["snapkv_kivi"] = dict(METHODS["snapkv"], kv_cache_dtype="kivi", block_size=16)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, **kw) -> LLM:
    base = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=8)
    return LLM(str(path), **{**base, **kw})


def _count_prefill(llm: LLM) -> Counter:
    """Prompt tokens each request computes (prefill rows seen by the runner), by request id."""
    counts: Counter = Counter()
    run = llm.engine.runner.run

    def counting(meta):
        for step in meta.steps:
            if not step.is_decode:
                counts[step.request_id] += step.num_new_tokens
        return run(meta)

    llm.engine.runner.run = counting
    return counts


def _uninterrupted(llm: LLM, turns: list[list[int]], n: int) -> list[tuple[int, ...]]:
    """One request that never ends: after each turn's ``n`` outputs the next turn's tokens are appended
    to it as more prompt, so its KV and method state simply carry on (nothing saved or restored)."""
    engine = llm.engine
    rid = engine.add_request(turns[0], SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    req = engine._requests[rid]
    outs = []
    for suffix in [*turns[1:], None]:
        got: list[int] = []
        while len(got) < n:
            for out in engine.step():
                got.extend(out.delta_token_ids)
        outs.append(tuple(got))
        if suffix is not None:
            req.token_ids.extend(suffix)
            req.prefill_len = req.num_tokens  # the method sees the new tokens as prompt, as a new turn does
    engine.abort_request(rid)
    return outs


def _scramble_tails(llm: LLM) -> None:
    """Fill every free tail row (a store with tails: KIVI's incomplete pages) with noise."""
    pool = llm.engine.runner.kv
    if pool.store.has_tail:
        assert not llm.engine.runner.tail_rows.held()
        for layer in pool.tails:
            for t in layer.values():
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(9)))


def _holders(llm: LLM) -> Counter:
    kv = llm.engine.kv
    held = Counter()
    for table in kv.chains.held_tables().values():
        held.update(table.block_ids)
    for req in llm.engine.scheduler.running:
        held.update(kv.tables(req.request_id).block_ids)  # every layer's (one table, or one per layer)
    return held


def _check_blocks(llm: LLM) -> None:
    """Every block's refcount equals its holders (idle chains and running requests), none is lost."""
    kv, held = llm.engine.kv, _holders(llm)
    assert all(kv.pool.refcount(b) == held.get(b, 0) for b in range(kv.num_blocks))
    assert kv.pool.num_used_blocks == len(held)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is several times faster than contending for a loaded box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.mark.parametrize("case", sorted(METHODS))
def test_resume_equals_uninterrupted_session_and_prefills_only_the_suffix(llama, case):
    llm = _llm(llama, **METHODS[case])
    # PyramidKV prefills a prompt longer than the step budget whole at admission, unlike a running
    # request's chunks: keep its suffixes within one chunk so both sessions chunk alike.
    turns = [_tokens(70, 0), _tokens(20 if case == "pyramidkv" else 45, 1), _tokens(5, 2)]
    expected = _uninterrupted(llm, turns, GREEDY.max_tokens)
    counts = _count_prefill(llm)
    prompt, outs, done = turns[0], [], 0
    for t, suffix in enumerate([None, *turns[1:]]):
        if suffix is not None:
            prompt = prompt + list(outs[-1]) + suffix
        _scramble_tails(llm)  # between turns another request may use any tail row: the chain carries its own
        out = llm.generate(prompt, GREEDY, chain_id="conv")[0]
        assert out.chain_id == "conv" and out.chain_status == ("created" if t == 0 else "resumed")
        assert out.reused_tokens == done
        if t:
            # The chain's processed tokens exclude the last sampled one: it is computed with the suffix.
            assert counts[out.request_id] == len(suffix) + 1 == len(prompt) - done
        done = len(prompt) + len(out.token_ids) - 1
        outs.append(out.token_ids)
        assert llm.engine.chain_info("conv").num_tokens == done
        _check_blocks(llm)
    assert outs == expected
    llm.drop_chain("conv")
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_exact_chain_equals_full_recompute_and_append_start(llama):
    """Dense KV is exact, so resuming a chain equals prefilling the whole prompt from scratch; a prompt
    that carries only what follows ``chain_append_start`` tokens of the chain means the same."""
    llm, fresh = _llm(llama), _llm(llama, enable_prefix_caching=False)
    p1, s2 = _tokens(61, 3), _tokens(9, 4)
    first = llm.generate(p1, GREEDY, chain_id="a")[0]
    full = p1 + list(first.token_ids) + s2
    llm.fork_chain("a", "b")
    llm.fork_chain("a", "c")
    resumed = llm.generate(full, GREEDY, chain_id="a")[0]
    start = len(p1) + 3  # the prompt restates the chain's history from there on
    restated = llm.generate(full[start:], GREEDY, chain_id="b", chain_append_start=start)[0]
    # Only the new tokens: the history includes the last sampled token, whose KV is not computed yet.
    appended = llm.generate(s2, GREEDY, chain_id="c", chain_append_start=len(p1) + len(first.token_ids))[0]
    reference = fresh.generate(full, GREEDY)[0]
    assert resumed.token_ids == restated.token_ids == appended.token_ids == reference.token_ids
    assert {o.reused_tokens for o in (resumed, restated, appended)} == {len(p1) + len(first.token_ids) - 1}
    assert restated.prompt_token_ids == appended.prompt_token_ids == tuple(full)
    with pytest.raises(ValueError, match="outside chain"):
        llm.generate(s2, GREEDY, chain_id="c", chain_append_start=len(full) + 99)


@pytest.mark.parametrize("case", ["dense", "snapkv", "adakv", "snapkv_kivi"])
def test_forks_continue_independently_and_free_everything(llama, case):
    """Two forks of one chain run in one batch (their shared blocks are copied on write: the partial
    last block on append, compacted blocks before compaction) and equal each branch run alone."""
    llm = _llm(llama, **METHODS[case])
    kv = llm.engine.kv
    copies = []
    take = kv.take_copies

    def recording_take():
        copies.extend(got := take())
        return got

    kv.take_copies = recording_take
    first = llm.generate(_tokens(76, 5), GREEDY, chain_id="src")[0]  # 81 processed: a partial block
    history = list(first.prompt_token_ids) + list(first.token_ids)
    f1, f2, f3 = (llm.fork_chain("src") for _ in range(3))
    _check_blocks(llm)
    branch_a, branch_b = history + _tokens(13, 6), history + _tokens(21, 7)
    together = llm.generate([branch_a, branch_b], GREEDY, chain_id=[f1, f2])
    assert copies, "the branches wrote into shared blocks without copying them"
    _check_blocks(llm)
    alone = llm.generate(branch_a, GREEDY, chain_id="src")[0], llm.generate(branch_b, GREEDY, chain_id=f3)[0]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    # A later turn of each branch sees only its own history.
    more = _tokens(5, 8)
    nxt = [list(o.prompt_token_ids) + list(o.token_ids) + more for o in together]
    again = llm.generate(nxt, GREEDY, chain_id=[f1, f2])
    twins = llm.generate(nxt, GREEDY, chain_id=["src", f3])
    assert [o.token_ids for o in again] == [o.token_ids for o in twins]
    assert again[0].token_ids != again[1].token_ids
    for cid in ("src", f1, f2, f3):
        llm.drop_chain(cid)
    assert kv.pool.num_used_blocks == 0 and len(kv.chains) == 0


def test_errors_where_specified(llama):
    llm = _llm(llama, **METHODS["snapkv"])
    engine = llm.engine
    p = _tokens(30, 9)
    out = llm.generate(p, GREEDY, chain_id="a")[0]
    history = p + list(out.token_ids)
    rid = engine.add_request(history + [5], GREEDY, chain_id="a")  # queued, holds the chain
    with pytest.raises(ChainBusyError):
        engine.add_request(history + [6], GREEDY, chain_id="a")
    with pytest.raises(ChainBusyError):
        llm.fork_chain("a")
    with pytest.raises(ChainBusyError):
        llm.drop_chain("a")
    engine.kv.chains.max_chains = 1
    with pytest.raises(ChainCapacityError):
        engine.add_request(p, GREEDY, chain_id="b")
    engine.abort_request(rid)  # hands the chain back unchanged
    assert llm.chain_info("a").num_tokens == len(history) - 1 and not llm.chain_info("a").busy
    with pytest.raises(ChainPrefixMismatchError):
        llm.generate([history[0] + 1, *history[1:], 5], GREEDY, chain_id="a")
    with pytest.raises(ChainPrefixMismatchError):
        llm.generate(history[:-1], GREEDY, chain_id="a")  # nothing new to compute
    with pytest.raises(UnknownChainError):
        llm.generate([5, 6], GREEDY, chain_id="zz", chain_append_start=0)
    with pytest.raises(UnknownChainError):
        llm.fork_chain("zz")
    with pytest.raises(UnknownChainError):
        llm.drop_chain("zz")
    with pytest.raises(ValueError, match="needs a chain_id"):
        llm.generate([5, 6], GREEDY, chain_append_start=0)
    with pytest.raises(ValueError, match="one chain_id for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], GREEDY, chain_id="a")
    salt, engine.kv.salt = engine.kv.salt, b"another model or method configuration"
    with pytest.raises(ChainFingerprintError):
        llm.generate(history + [5], GREEDY, chain_id="a")
    engine.kv.salt = salt
    assert not engine.has_unfinished_requests()
    assert llm.generate(p, GREEDY, chain_id="b")[0].chain_status == "created"  # forgot idle "a" for room
    assert "a" not in engine.kv.chains


def test_idle_chains_give_their_kv_back_before_anything_is_preempted(llama):
    llm = _llm(llama, **METHODS["snapkv"], num_kv_blocks=14)
    engine = llm.engine
    p = _tokens(40, 10)
    out = llm.generate(p, GREEDY, chain_id="a")[0]
    assert engine.chain_info("a").num_blocks > 0
    big = llm.generate(_tokens(100, 11), GREEDY)[0]  # needs the whole pool at its peak
    assert len(big.token_ids) == GREEDY.max_tokens and engine.scheduler.num_preemptions == 0
    info = engine.chain_info("a")
    assert info.num_blocks == 0 and info.num_tokens == len(p) + len(out.token_ids) - 1
    prompt = p + list(out.token_ids) + _tokens(6, 12)
    again = llm.generate(prompt, GREEDY, chain_id="a")[0]
    assert again.chain_status == "recreated" and again.reused_tokens == 0
    assert again.token_ids == llm.generate(prompt, GREEDY)[0].token_ids  # recomputed from its tokens
    assert engine.chain_info("a").num_blocks > 0


def test_abort_mid_turn_leaves_a_consistent_chain(llama):
    llm = _llm(llama, **METHODS["h2o"])
    engine = llm.engine
    p = _tokens(50, 13)
    rid = engine.add_request(p, GREEDY, chain_id="a")
    engine.step()  # one 32-token prefill chunk
    engine.abort_request(rid)
    assert engine.chain_info("a").num_tokens == 32
    out = llm.generate(p + [7], GREEDY, chain_id="a")[0]
    assert out.chain_status == "resumed" and out.reused_tokens == 32
    _check_blocks(llm)


@pytest.mark.parametrize("case", ["h2o", "snapkv"])
def test_a_turn_ended_before_its_first_step_gives_the_chain_its_state_back(llama, case):
    """The chain's method state reaches the method with the resumed request's first step; a turn aborted
    before that step hands the chain back the state it took, so the next turn equals a fork's turn."""
    llm = _llm(llama, **METHODS[case])
    engine = llm.engine
    first = llm.generate(_tokens(50, 14), GREEDY, chain_id="a")[0]
    llm.fork_chain("a", "twin")  # shares the chain's blocks and state
    prompt = list(first.prompt_token_ids) + list(first.token_ids) + _tokens(9, 15)
    rid = engine.add_request(prompt, GREEDY, chain_id="a")
    assert engine._requests[rid].state_to_resume is not None  # not handed to the method yet
    engine.abort_request(rid)
    steps = _count_prefill(llm)
    again, twin = (llm.generate(prompt, GREEDY, chain_id=c)[0] for c in ("a", "twin"))
    assert again.chain_status == twin.chain_status == "resumed"
    assert again.token_ids == twin.token_ids
    assert steps[again.request_id] == steps[twin.request_id] == 10  # the suffix and the last sampled token


def test_no_room_to_copy_before_compaction_recomputes_instead(llama, monkeypatch):
    """If the pool cannot supply copies of shared blocks when a compaction needs them, the request is
    preempted (it recomputes) rather than writing into a fork's blocks."""
    llm = _llm(llama, **METHODS["snapkv"])
    engine = llm.engine
    first = llm.generate(_tokens(60, 14), GREEDY, chain_id="a")[0]
    fork = llm.fork_chain("a")
    before = engine.chain_info(fork)
    monkeypatch.setattr(engine.kv, "make_exclusive", lambda *a: False)
    prompt = list(first.prompt_token_ids) + list(first.token_ids) + _tokens(10, 15)
    out = llm.generate(prompt, GREEDY, chain_id="a")[0]
    assert len(out.token_ids) == GREEDY.max_tokens and engine.scheduler.num_preemptions >= 1
    assert engine.chain_info(fork) == before
    _check_blocks(llm)
    monkeypatch.undo()
    # The fork's KV is intact: resuming it equals resuming an untouched copy of the same history.
    twin = _llm(llama, **METHODS["snapkv"])
    twin.generate(list(first.prompt_token_ids), GREEDY, chain_id="t")
    ours, theirs = llm.generate(prompt, GREEDY, chain_id=fork)[0], twin.generate(prompt, GREEDY, chain_id="t")[0]
    assert ours.chain_status == theirs.chain_status == "resumed" and ours.token_ids == theirs.token_ids


def test_queued_requests_give_up_pinned_chain_kv_when_nothing_else_fits(llama):
    """Waiting requests hold their chains' KV; when that leaves the oldest no room and nothing runs,
    the newest give it up and recompute instead of stalling the engine."""
    llm = _llm(llama, **METHODS["snapkv"], num_kv_blocks=16)
    first = llm.generate(_tokens(40, 16), GREEDY, chain_id="a")[0]
    fork = llm.fork_chain("a")
    history = list(first.prompt_token_ids) + list(first.token_ids)
    # Each resumed prompt's peak (retained + 60) leaves no room to copy the blocks both chains share.
    outs = llm.generate([history + _tokens(60, 17), history + _tokens(60, 18)], GREEDY, chain_id=["a", fork])
    assert llm.engine.scheduler.num_preemptions == 1
    assert [o.chain_status for o in outs] == ["resumed", "recreated"]
    assert outs[0].reused_tokens == len(history) - 1 and outs[1].reused_tokens == 0
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    _check_blocks(llm)
