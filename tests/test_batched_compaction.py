"""A step's compactions in one ``compact_kv`` launch per layer (issue 15): the per-request path is the
reference. Two engines run the same requests in lockstep, one applying each request's compaction alone
(``batched_compaction = False``), and hold, after every step, the same tokens, KV lengths, block tables
and KV rows in the slots those tables hold: SnapKV, PyramidKV (per-layer tables)
and AdaKV (head-major lanes) with several requests compacting at one step, the pipelined loop, forks of
a chain compacting together (their shared blocks copied first), and a pool too small for every request
(preemptions). The batched engine's decode compactions come from the rounds' rows (``Compaction.rows``).
"""

from __future__ import annotations

import random

import pytest
import torch
from test_async_scheduling import greedy
from test_eviction_pipeline import DECODE_EVICTING
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM
from sparse_serve.step_metadata import table_slots

_rng = random.Random(21)
PROMPTS = [[_rng.randrange(3, 4000) for _ in range(n)] for n in (30, 45, 60, 70, 52)]
ADAKV = dict(sparse_method="adakv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=16)
ADAKV |= dict(observation_window_size=8)
# Windows no longer than the interval: a decode eviction ranks each layer's requests as one round.
ROUNDS = {
    m: DECODE_EVICTING[m] | dict(observation_window_size=4, decode_eviction_interval=i)
    for m, i in (("snapkv", 6), ("pyramidkv", 5))
}
CONFIG = dict(device="cpu", dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=512)
CONFIG |= dict(max_num_seqs=8, async_scheduling=False)


def _pair(method: dict, **config) -> tuple[LLM, LLM]:
    """(batched, per-request) engines of one configuration."""
    llms = tuple(LLM(str(DEFAULT_MODEL), **(CONFIG | method | config)) for _ in range(2))
    llms[1].engine.batched_compaction = False
    return llms


def _state(llm: LLM) -> dict:
    """Per live request: its tokens, KV lengths, block tables and the K/V rows its tables hold (per
    layer, or per (layer, KV head) lane: a head-major pool's rows are one head's)."""
    engine, pool = llm.engine, llm.engine.runner.kv
    heads = engine.kv.layout.heads
    state = {}
    for rid, req in sorted(engine._requests.items()):
        if not engine.kv.has_request(rid):
            continue
        tables = [tuple(t) for t in engine._tables(req)]
        rows = []
        for t, (table, kv_len) in enumerate(zip(tables, req.kv_lens, strict=True)):
            layer = t // heads
            slots = table_slots(table, kv_len, engine.config.block_size)
            for cache in (pool.k[layer], pool.v[layer]):
                rows.append(cache.view(-1, *cache.shape[2:])[slots])
        state[rid] = (tuple(req.token_ids), tuple(req.kv_lens), tables, rows)
    return state


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][:3] == b[rid][:3], rid
        assert all(torch.equal(x, y) for x, y in zip(a[rid][3], b[rid][3], strict=True)), rid


def _lockstep(llms: tuple[LLM, LLM], *requests: list[tuple], max_steps: int = 200) -> list[int]:
    """Add ``requests`` ((id, prompt, params[, add_request keywords])) to both engines (or a list to each)
    and step them together, comparing after every step; returns how many requests compacted at each step
    and how many of those from a batched round's rows (``Compaction.rows``)."""
    compacting = []
    spied = llms[0].engine.method.finish_step

    def finish_step():
        out = spied()
        compacting.append((len(out), sum(bool(c.rows) for c in out.values())))
        return out

    llms[0].engine.method.finish_step = finish_step
    for llm, reqs in zip(llms, requests * (3 - len(requests)), strict=True):
        for rid, prompt, params, *kw in reqs:
            llm.engine.add_request(prompt, params, request_id=rid, **(kw[0] if kw else {}))
    for _ in range(max_steps):
        if not llms[0].engine.has_unfinished_requests():
            break
        outs = [[(o.request_id, o.token_ids, o.finished) for o in llm.engine.step()] for llm in llms]
        assert outs[0] == outs[1]
        _assert_same(_state(llms[0]), _state(llms[1]))
    else:
        raise AssertionError("the engines did not finish")
    assert not llms[1].engine.has_unfinished_requests()
    return compacting


def _requests(n_tokens: int = 16) -> list[tuple]:
    return [(f"r{i}", p, greedy(n_tokens + 3 * i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize(
    "method, config",
    [
        (DECODE_EVICTING["snapkv"], {}),
        (DECODE_EVICTING["pyramidkv"], {}),
        (ADAKV, {}),
        (DECODE_EVICTING["snapkv"], dict(async_scheduling=True)),  # the pipelined loop: _advance_all
        (ROUNDS["snapkv"], {}),
        (ROUNDS["pyramidkv"], {}),
        (ROUNDS["snapkv"], dict(async_scheduling=True)),
    ],
    ids=["snapkv", "pyramidkv", "adakv", "snapkv-pipelined", "snapkv-round", "pyramidkv-round", "round-pipelined"],
)
def test_batched_compaction_equals_each_request_alone(method, config):
    llms = _pair(method, **config)
    compacting = _lockstep(llms, _requests())
    assert max(n for n, _ in compacting) >= 4  # several requests compacted at one step
    if method in ROUNDS.values():  # decode rounds' from their rows (Compaction.rows), the prefills' plain
        assert max(r for _, r in compacting) >= 4 and any(n and not r for n, r in compacting)
    if method is ADAKV:
        assert llms[0].engine.kv.layout.heads > 1
    if method is DECODE_EVICTING["pyramidkv"]:
        assert llms[0].engine.kv.layout.per_layer


def test_a_tight_pool_preempts_as_request_by_request():
    """Four requests of 5 blocks in 22 blocks: their sixth blocks do not all fit, one is preempted."""
    llms = _pair(DECODE_EVICTING["snapkv"], num_kv_blocks=22, max_model_len=160)
    compacting = _lockstep(llms, [(f"r{i}", p[:38], greedy(24, ignore_eos=True)) for i, p in enumerate(PROMPTS[1:])])
    assert max(n for n, _ in compacting) >= 3
    preemptions = [llm.engine.scheduler.num_preemptions for llm in llms]
    assert preemptions[0] == preemptions[1] > 0


@pytest.mark.parametrize("window", [8, 3], ids=["alone", "round"])
def test_forks_compacting_together_copy_their_shared_blocks_first(window):
    """Forks of one chain resume in one batch: each copies the blocks it shares before its compaction,
    possibly into blocks that the requests before it free, as request by request."""
    method = DECODE_EVICTING["snapkv"] | dict(decode_eviction_interval=3, observation_window_size=window)
    llms = _pair(method)
    first = [llm.generate(PROMPTS[1], greedy(6, ignore_eos=True), chain_id="src")[0] for llm in llms]
    assert first[0].token_ids == first[1].token_ids
    history = list(first[0].prompt_token_ids) + list(first[0].token_ids)
    copies = []
    take = llms[0].engine.kv.take_copies
    llms[0].engine.kv.take_copies = lambda: copies.extend(got := take()) or got
    turns = []
    for llm in llms:
        chains = [llm.fork_chain("src") for _ in range(3)] + ["src"]
        turns.append(
            [
                (f"t{i}", history + PROMPTS[i][:8], greedy(9, ignore_eos=True), {"chain_id": c})
                for i, c in enumerate(chains)
            ]
        )
        turns[-1].append(("plain", PROMPTS[4], greedy(12, ignore_eos=True)))
    compacting = _lockstep(llms, *turns)
    assert max(n for n, _ in compacting) >= 3 and copies
    assert (max(r for _, r in compacting) >= 3) == (window == 3)  # the forks' compactions from a round's rows
