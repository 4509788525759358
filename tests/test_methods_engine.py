"""Eviction methods end to end on CPU: identity at large budgets, continuous batching with mixed prompt
lengths, memory that matches each method's plan, real reclaim, and admission that packs by the plan."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_serve import LLM, SamplingParams

BLOCK = 8
SMALL_BUDGETS = {
    "streamingllm": dict(
        sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=36, decode_eviction_interval=8
    ),
    "snapkv": dict(
        sparse_method="snapkv",
        sink_keep_tokens=4,
        decode_keep_tokens=20,
        recent_keep_tokens=16,
        observation_window_size=8,
    ),
    "snapkv_decode": dict(
        sparse_method="snapkv",
        sink_keep_tokens=4,
        decode_keep_tokens=20,
        recent_keep_tokens=16,
        observation_window_size=8,
        decode_eviction_interval=6,
    ),
    "pyramidkv": dict(
        sparse_method="pyramidkv",
        sink_keep_tokens=4,
        decode_keep_tokens=36,
        recent_keep_tokens=8,
        observation_window_size=8,
        pyramidkv_beta=2.0,
        decode_eviction_interval=6,
    ),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=40, h2o_decode_budget=24, decode_eviction_interval=6),
    "h2o_prefill": dict(
        sparse_method="h2o", prefill_sparse_method="h2o_prefill", h2o_prefill_budget=40, h2o_prefill_score_window=8
    ),
    "tova": dict(sparse_method="tova", decode_keep_tokens=35),  # evicts after every chunk and every token
    "rkv": dict(  # the prompt stays whole; every 6 generated tokens back to 40
        sparse_method="rkv",
        sink_keep_tokens=0,
        decode_keep_tokens=32,
        recent_keep_tokens=8,
        rkv_compression_interval=6,
        rkv_observation_tokens=4,
    ),
    "skipkv": dict(  # the prompt stays whole; a layer at 40 + 6 goes back to 40
        sparse_method="skipkv",
        sink_keep_tokens=4,
        decode_keep_tokens=28,
        recent_keep_tokens=8,
        skipkv_compression_interval=6,
        skipkv_redundancy_window=8,
        skipkv_segment_size=4,
    ),
}
LARGE_BUDGETS = {
    "streamingllm": dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=1000),
    "snapkv": dict(sparse_method="snapkv", decode_keep_tokens=1000, decode_eviction_interval=4),
    "pyramidkv": dict(sparse_method="pyramidkv", decode_keep_tokens=1000, decode_eviction_interval=4),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=1000, h2o_decode_budget=1000, decode_eviction_interval=4),
    "h2o_prefill": dict(sparse_method="h2o", prefill_sparse_method="h2o_prefill", h2o_prefill_budget=1000),
    "tova": dict(sparse_method="tova", decode_keep_tokens=1000),
    "rkv": dict(sparse_method="rkv", decode_keep_tokens=1000, rkv_compression_interval=4, rkv_observation_tokens=4),
    "skipkv": dict(sparse_method="skipkv", decode_keep_tokens=1000, skipkv_compression_interval=4),
}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def _llm(path, **kw):
    base = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=8)
    return LLM(str(path), **{**base, **kw})


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.mark.parametrize("case", sorted(LARGE_BUDGETS))
def test_budget_at_least_context_is_dense(llama, case):
    """With budgets above every context, a method keeps everything: greedy outputs equal dense exactly."""
    prompts = _prompts([5, 37, 90, 120, 64])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    dense = [o.token_ids for o in _llm(llama).generate(prompts, params)]
    ours = [o.token_ids for o in _llm(llama, **LARGE_BUDGETS[case]).generate(prompts, params)]
    assert ours == dense


def _check_step_invariants(engine, seen_prefill: set):
    """Tables hold exactly the blocks their longest layer needs (each layer its own, with a table per
    layer); the pool's used blocks are theirs; each request stays within its plan, and right after
    prefill holds exactly its planned resident KV (in blocks: the sum over layers with per-layer tables)."""
    used = 0
    for req in engine.scheduler.running:
        rid = req.request_id
        if not engine.kv.has_request(rid):
            continue
        lens = req.kv_lens if engine.kv.per_layer else [req.kv_len]
        for layer, n in enumerate(lens):
            assert len(engine.kv.table(rid, layer).block_ids) == math.ceil(n / BLOCK)
        used += engine.kv.num_held_blocks(rid)
        plan = engine.method.memory_plan(req.prefill_len, req.max_new_tokens, engine.config.max_num_batched_tokens)
        if req.num_computed_tokens < req.prefill_len:
            assert all(n <= p for n, p in zip(req.kv_lens, plan.prefill_peak_tokens, strict=True))
        else:
            assert all(n <= p for n, p in zip(req.kv_lens, plan.decode_peak_tokens, strict=True))
            if req.request_id not in seen_prefill:
                seen_prefill.add(req.request_id)
                # The first step after prefill: the prompt is compressed to the plan's resident size
                # (+1: the first sampled token was stored since, unless this step was the prefill itself).
                extra = req.num_computed_tokens - req.prefill_len
                assert [n - extra for n in req.kv_lens] == list(plan.resident_tokens)
                resident = [n + extra for n in plan.resident_tokens]
                blocks = [math.ceil(n / BLOCK) for n in (resident if engine.kv.per_layer else [max(resident)])]
                assert engine.kv.num_held_blocks(rid) == sum(blocks)
    assert engine.kv.pool.num_used_blocks == used


@pytest.mark.parametrize("case", sorted(SMALL_BUDGETS))
def test_methods_under_continuous_batching(llama, case):
    """Mixed prompt lengths arriving over time; every request finishes; memory follows the plan; nothing leaks."""
    llm = _llm(llama, **SMALL_BUDGETS[case])
    engine = llm.engine
    assert engine.kv.per_layer == (case == "pyramidkv")  # per-layer budgets: a table per layer
    prompts = _prompts([150, 20, 97, 60, 130, 33, 75])
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    finished, seen = {}, set()
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step: arrivals mid-generation
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=str(i))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        _check_step_invariants(engine, seen)
    assert sorted(finished) == [str(i) for i in range(len(prompts))]
    assert all(len(o.token_ids) == 20 for o in finished.values())
    assert engine.kv.pool.num_used_blocks == 0
    if case != "streamingllm":  # prompts over budget were really compressed
        assert len(seen) == len(prompts)


def test_free_blocks_after_prefill_match_the_plan(llama):
    """Four prompts prefilled in one step: the pool's free blocks equal total minus the plans' resident blocks."""
    cfg = SMALL_BUDGETS["snapkv"]
    llm = _llm(llama, max_num_batched_tokens=1024, **cfg)
    engine = llm.engine
    prompts = _prompts([150, 20, 97, 60], seed=3)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=5, temperature=0.0))
    engine.step()
    resident = [engine.method.memory_plan(len(p), 5, 1024).resident_tokens for p in prompts]
    expected_used = sum(math.ceil(max(r) / BLOCK) for r in resident)
    assert engine.num_free_blocks == engine.kv.num_blocks - expected_used
    assert [max(r) for r in resident] == [40, 20, 40, 40]  # sink 4 + keep 20 + recent 16, or the whole prompt


def test_h2o_prefill_bounds_the_prefill_peak(llama):
    """h2o_prefill compacts between chunks: a 300-token prompt never holds more than budget + one chunk."""
    llm = _llm(llama, **SMALL_BUDGETS["h2o_prefill"])
    engine = llm.engine
    engine.add_request(_prompts([300])[0], SamplingParams(max_tokens=3, temperature=0.0))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            peak = max(peak, req.kv_len)
    assert 40 < peak <= 40 + 32


def _max_concurrent_decodes(path, **method) -> int:
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        max_num_batched_tokens=256,
        num_kv_blocks=90,
        **method,
    )
    engine = llm.engine
    for p in _prompts([200] * 8, seed=5):
        engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        decoding = [r for r in engine.scheduler.running if r.num_computed_tokens >= r.prefill_len]
        most = max(most, len(decoding))
    return most


def test_eviction_lets_more_requests_run(llama):
    """A 90-block pool: dense holds 3 requests of 200 tokens at once, SnapKV at 40 tokens all 8."""
    dense = _max_concurrent_decodes(llama)
    snap = _max_concurrent_decodes(llama, **SMALL_BUDGETS["snapkv"])
    assert dense <= 3 and snap == 8


def test_long_bs1full_prefill_runs_whole_prompts_alone(llama):
    """PyramidKV's policy: a prompt longer than the chunk budget is prefilled in one step, alone
    (decodes may share it), and short prompts are batched as usual."""
    llm = _llm(llama, max_num_batched_tokens=64, **SMALL_BUDGETS["pyramidkv"])
    engine = llm.engine
    lengths = {"long-a": 150, "short": 20, "long-b": 130}
    for rid, n in lengths.items():
        engine.add_request(_prompts([n], seed=n)[0], SamplingParams(max_tokens=3, temperature=0.0), request_id=rid)
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append([(r.request_id, n) for r, n in batch.items if r.num_computed_tokens < r.prefill_len])
        return batch

    engine.scheduler.schedule = recording_schedule
    while engine.has_unfinished_requests():
        engine.step()
    long_steps = [s for s in steps if any(lengths[rid] > 64 for rid, _ in s)]
    assert sorted(long_steps) == [[("long-a", 150)], [("long-b", 130)]]
    assert any(("short", 20) in s for s in steps)


@pytest.mark.parametrize("method", ["streamingllm", "pyramidkv", "tova"])
def test_decode_eviction_interval_zero_means_never(llama, method):
    """``decode_eviction_interval=0`` through ``LLM(...)``: no decode-time eviction even for a method
    whose default evicts on an interval; a prompt within the budget then decodes exactly as dense."""
    budget = (
        dict(sink_keep_tokens=4, recent_keep_tokens=28) if method == "streamingllm" else dict(decode_keep_tokens=40)
    )
    prompts = _prompts([20, 24])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = _llm(llama, sparse_method=method, decode_eviction_interval=0, **budget)
    assert llm.engine.method.config.decode_eviction_interval == 0
    assert set(llm.engine.method.memory_plan(20, 40, 32).decode_peak_tokens) == {60}  # grows, never cut
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert ours == [o.token_ids for o in _llm(llama).generate(prompts, params)]
    with pytest.raises(ValueError, match="decode_eviction_interval"):
        _llm(llama, sparse_method=method, decode_eviction_interval=-1, **budget)


def _admitted(engine, prompt_len: int) -> int:
    """Synthetic requests (prefilled to their method's resident KV) that fit the pool at once."""
    n = 0
    while True:
        try:
            engine.add_synthetic_request(prompt_len, SamplingParams(max_tokens=1))
        except ValueError:
            return n
        n += 1


def test_pyramidkv_admits_at_least_as_many_as_snapkv(llama):
    """Equal average budget (PyramidKV's layers average SnapKV's): with a table per layer PyramidKV holds
    the sum of its per-layer budgets, not its bottom layer's times the layers, so it packs at least as
    many requests into the same pool."""
    budget = dict(sink_keep_tokens=4, decode_keep_tokens=36, recent_keep_tokens=8, observation_window_size=8)
    counts = {}
    for name, extra in (("snapkv", {}), ("pyramidkv", dict(pyramidkv_beta=2.0))):
        engine = _llm(llama, sparse_method=name, num_kv_blocks=60, max_num_seqs=64, **budget, **extra).engine
        counts[name] = _admitted(engine, 300)
        resident = engine.method.memory_plan(300, 1, 32).resident_tokens
        per_request = engine.kv.num_blocks_for(list(resident))
        assert engine.kv.pool.num_used_blocks == counts[name] * per_request
        if name == "pyramidkv":
            assert sum(resident) == 48 * len(resident) and len(set(resident)) > 1  # the same average budget
            assert per_request == sum(math.ceil(n / BLOCK) for n in resident) < math.ceil(max(resident) / BLOCK) * 3
    assert counts["pyramidkv"] >= counts["snapkv"] > 0
