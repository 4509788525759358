"""Pipelined decode (``async_scheduling``) produces what the synchronous loop produces.

The CPU runs the same control flow as CUDA (a "launch" there simply computes), so these tests hold
every request's output equal between the two loops on workloads that end requests in every way
(EOS, stop ids, stop strings, max_tokens, aborts), add requests mid-generation, share prefixes,
preempt, evict (pipelined between compactions, chains) and stream; and they check that no block leaks.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, SamplingParams
from sparse_serve.sampler import TokenFeed

_rng = random.Random(3)
_BASE = [_rng.randrange(3, 4000) for _ in range(40)]
PROMPTS = [
    _BASE[:n] + [_rng.randrange(3, 4000) for _ in range(m)] for n, m in [(40, 3), (40, 9), (7, 1), (0, 30), (33, 2)]
]


class Trace:
    """Per request: the final output and the concatenated streamed deltas."""

    def __init__(self):
        self.final: dict[str, tuple] = {}
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.chains: dict = {}

    def record(self, outputs) -> None:
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
            self.text[out.request_id] = self.text.get(out.request_id, "") + out.delta_text
            assert tuple(self.tokens[out.request_id]) == out.token_ids  # deltas add up
            if out.finished:
                assert out.request_id not in self.final, "a request finished twice"
                self.final[out.request_id] = (out.token_ids, out.text, out.finish_reason, out.stop_reason)


def drive(llm: LLM, script: dict[int, list[tuple]], max_steps: int = 400, chains: tuple[str, ...] = ()) -> Trace:
    """Step the engine; before step ``i`` apply ``script[i]``: ("add", id, prompt, params[, add_request
    keywords]) or ("abort", id)."""
    engine, trace = llm.engine, Trace()
    free = engine.num_free_blocks
    last = max(script, default=0)
    for i in range(max_steps):
        for event in script.get(i, ()):
            if event[0] == "add":
                engine.add_request(event[2], event[3], request_id=event[1], **(event[4] if len(event) > 4 else {}))
            else:
                engine.abort_request(event[1])
        if i > last and not engine.has_unfinished_requests():
            break
        trace.record(engine.step())
    else:
        raise AssertionError("the engine did not finish")
    trace.chains = {chain_id: engine.chain_info(chain_id) for chain_id in chains}
    for chain_id in chains:  # what the chains retain goes back to the pool
        engine.drop_chain(chain_id)
    assert engine.num_free_blocks == free, "blocks leaked"
    assert engine.kv.pool.num_used_blocks == 0
    return trace


def both(script, **config) -> tuple[Trace, Trace, LLM]:
    """(synchronous trace, pipelined trace, the pipelined LLM)."""
    config = dict(device="cpu", max_model_len=256) | config
    sync = drive(LLM(str(DEFAULT_MODEL), async_scheduling=False, **config), script)
    llm = LLM(str(DEFAULT_MODEL), async_scheduling=True, **config)
    return sync, drive(llm, script), llm


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def _reference_tokens(prompt, n: int) -> tuple[int, ...]:
    llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=1024, async_scheduling=False)
    return llm.generate([prompt], greedy(n, ignore_eos=True))[0].token_ids


def test_stops_of_every_kind_match_the_synchronous_loop():
    ref = _reference_tokens(PROMPTS[0], 12)
    llm_tok = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=256).tokenizer
    text = llm_tok.decode(list(_reference_tokens(PROMPTS[1], 12)))
    script = {
        0: [
            ("add", "stop-id", PROMPTS[0], greedy(30, ignore_eos=True, stop_token_ids=[ref[4]])),
            ("add", "stop-str", PROMPTS[1], greedy(30, ignore_eos=True, stop=[text[5:8]])),
            ("add", "len", PROMPTS[2], greedy(7, ignore_eos=True)),
            ("add", "len1", PROMPTS[3], greedy(1, ignore_eos=True)),
            ("add", "eos", PROMPTS[0], greedy(30)),
        ]
    }
    sync, pipelined, llm = both(script)
    assert pipelined.final == sync.final and pipelined.text == sync.text
    assert sync.final["stop-id"][2:] == ("stop", ref[4])
    assert sync.final["stop-str"][2] == "stop" and sync.final["len"][2] == "length"
    assert llm.engine.num_pipelined_steps > 0


def test_eos_stops_drop_the_extra_token():
    ref = _reference_tokens(PROMPTS[3], 10)
    for eos_at in (0, 3, 6):
        llms = []
        for flag in (False, True):
            llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=256, async_scheduling=flag)
            llm.engine.eos_token_ids = frozenset({ref[eos_at]})
            llms.append(llm)
        outs = [llm.generate([PROMPTS[3], PROMPTS[4]], greedy(12)) for llm in llms]
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
        assert outs[1][0].token_ids == ref[: ref.index(ref[eos_at]) + 1]
        assert all(llm.engine.kv.pool.num_used_blocks == 0 for llm in llms)


def test_aborts_and_arrivals_mid_generation():
    script = {
        0: [("add", f"r{i}", PROMPTS[i], greedy(16, ignore_eos=True)) for i in range(3)],
        3: [("abort", "r1"), ("add", "late", PROMPTS[3], greedy(8, ignore_eos=True))],
        5: [("abort", "r2"), ("abort", "unknown")],
        6: [("add", "later", PROMPTS[4], greedy(5, ignore_eos=True)), ("abort", "r0")],
    }
    sync, pipelined, llm = both(script)
    # Requests added at the start emit in the same calls, so aborts cut them at the same token.
    assert pipelined.tokens == sync.tokens
    assert pipelined.final == sync.final
    assert set(sync.final) == {"late", "later"}  # aborted requests send no final output
    assert llm.engine.num_pipelined_steps > 0


def test_prefix_caching_and_staggered_arrivals():
    script = {i: [("add", f"r{i}", PROMPTS[i], greedy(6 + 2 * i, ignore_eos=True))] for i in range(5)}
    script[2].append(("add", "dup", PROMPTS[0], greedy(9, ignore_eos=True)))
    sync, pipelined, llm = both(script, block_size=8)
    assert pipelined.final == sync.final
    assert llm.engine.prefix_hit_tokens > 0 and llm.engine.num_pipelined_steps > 0


def test_tight_pool_preempts_and_recovers():
    script = {0: [("add", f"r{i}", PROMPTS[i], greedy(40, ignore_eos=True)) for i in range(4)]}
    sync, pipelined, llm = both(script, block_size=4, num_kv_blocks=40, max_model_len=96)
    assert pipelined.final == sync.final
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.num_pipelined_steps > 0


EVICTING = {
    "snapkv": dict(sparse_method="snapkv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=16)
    | dict(observation_window_size=8),
    "streamingllm": dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=20)
    | dict(decode_eviction_interval=5),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=30, h2o_decode_budget=24, h2o_prefill_score_window=8),
    "pyramidkv": dict(
        sparse_method="pyramidkv",
        sink_keep_tokens=4,
        decode_keep_tokens=20,
        recent_keep_tokens=16,
        observation_window_size=8,
        decode_eviction_interval=0,
    ),
}


def _count_compactions(llm: LLM) -> list[int]:
    """A one-element counter of the compactions the engine's method hands out from now on."""
    method, count = llm.engine.method, [0]
    finish = method.finish_step

    def counted():
        out = finish()
        count[0] += len(out)
        return out

    method.finish_step = counted
    return count


@pytest.mark.parametrize("method", sorted(EVICTING))
def test_evicting_methods_pipeline_between_compactions(method):
    """Decode steps that compact and observe nothing are pipelined for evicting methods too (chunked
    prefill, arrivals while decoding, an abort, a stop id): the same outputs as the synchronous loop."""
    ref = _reference_tokens(PROMPTS[0], 12)
    script = {
        0: [
            ("add", "a", PROMPTS[0], greedy(14, ignore_eos=True)),
            ("add", "b", PROMPTS[3], greedy(12, ignore_eos=True, stop_token_ids=[ref[7]])),
            ("add", "x", PROMPTS[2], greedy(30, ignore_eos=True)),
        ],
        4: [("add", "c", PROMPTS[1], greedy(9, ignore_eos=True))],
        7: [("add", "d", PROMPTS[4], greedy(11, ignore_eos=True))],
        10: [("abort", "x")],
    }
    config = dict(device="cpu", max_model_len=256, block_size=8, max_num_batched_tokens=16, **EVICTING[method])
    sync = drive(LLM(str(DEFAULT_MODEL), async_scheduling=False, **config), script)
    llm = LLM(str(DEFAULT_MODEL), async_scheduling=True, **config)
    compactions = _count_compactions(llm)
    pipelined = drive(llm, script)
    assert pipelined.tokens == sync.tokens and pipelined.final == sync.final
    assert compactions[0] > 0 and llm.engine.num_pipelined_steps > 0


def test_evicting_chains_resume_alike_with_pipelined_neighbours():
    """A chain's turns (never pipelined themselves) beside a pipelined decode: both loops resume the
    same retained KV and produce the same tokens."""
    turn = greedy(6, ignore_eos=True)
    script = {
        0: [
            ("add", "long", PROMPTS[2], greedy(40, ignore_eos=True)),
            ("add", "t1", PROMPTS[0], turn, {"chain_id": "c"}),
        ],
        14: [("add", "t2", PROMPTS[1][:9], turn, {"chain_id": "c", "chain_append_start": len(PROMPTS[0]) + 6})],
        22: [("add", "t3", PROMPTS[4][:5], turn, {"chain_id": "c", "chain_append_start": len(PROMPTS[0]) + 21})],
    }
    config = dict(device="cpu", max_model_len=256, block_size=8, max_num_batched_tokens=16, **EVICTING["snapkv"])
    sync = drive(LLM(str(DEFAULT_MODEL), async_scheduling=False, **config), script, chains=("c",))
    llm = LLM(str(DEFAULT_MODEL), async_scheduling=True, **config)
    pipelined = drive(llm, script, chains=("c",))
    assert pipelined.tokens == sync.tokens and pipelined.final == sync.final
    assert pipelined.chains == sync.chains and sync.chains["c"].num_tokens == len(PROMPTS[0]) + 31
    assert sync.final["t3"][:1] and llm.engine.num_pipelined_steps > 0


def test_streaming_deltas_match():
    params = greedy(14, ignore_eos=True)
    streams = []
    for flag in (False, True):
        llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=256, async_scheduling=flag)
        streams.append(
            [(o.request_id, o.delta_token_ids, o.delta_text, o.finished) for o in llm.stream(PROMPTS[:3], params)]
        )
    # Nothing arrives mid-generation: the two loops emit the same updates in the same order.
    assert streams[0] == streams[1]


def test_abandoned_stream_frees_blocks_with_a_step_in_flight():
    llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=256, async_scheduling=True)
    free = llm.engine.num_free_blocks
    stream = llm.stream(PROMPTS[:2], greedy(20, ignore_eos=True))
    for _ in range(6):
        next(stream)
    stream.close()
    assert llm.engine._inflight is None and llm.engine.num_free_blocks == free
    # The engine keeps serving afterwards.
    assert llm.generate([PROMPTS[2]], greedy(3, ignore_eos=True))[0].token_ids == _reference_tokens(PROMPTS[2], 3)


QUERY_AWARE = {
    "quest": dict(sparse_method="quest", sink_keep_tokens=16, decode_keep_tokens=48, recent_keep_tokens=32),
    "omnikv": dict(sparse_method="omnikv", sink_keep_tokens=8, decode_keep_tokens=40, recent_keep_tokens=24),
}
LONG = [_rng.randrange(3, 4000) for _ in range(300)]


@pytest.mark.parametrize("method", sorted(QUERY_AWARE))
def test_query_aware_methods_pipeline_and_match(method):
    ref = _reference_tokens(LONG, 8)
    script = {
        0: [
            ("add", "a", LONG, greedy(12, stop_token_ids=[ref[5]])),
            ("add", "b", LONG[:200], greedy(9, ignore_eos=True)),
        ],
        4: [("add", "c", LONG[50:], greedy(4, ignore_eos=True))],
    }
    sync, pipelined, llm = both(script, block_size=16, max_model_len=1024, **QUERY_AWARE[method])
    assert pipelined.final == sync.final and llm.engine.num_pipelined_steps > 0


def test_token_feed_equals_its_reference():
    tokens = torch.tensor([11, 12, 13, 14])
    for rows, sources in [([0, 1, 2], [0, 1, 2]), ([2, 0], [3, 1]), ([], []), ([1], [0])]:
        fast, ref = torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
        feed = TokenFeed(tokens, rows, sources)
        feed.apply_(fast)
        feed.apply_reference(ref)
        assert torch.equal(fast, ref)


@pytest.mark.parametrize("method", ["dense", "quest", "omnikv"])
def test_bench_counts_reads_like_its_reference_and_times_pipelined_steps(method):
    from sparse_serve.bench.decode import DecodeCase, _step_kv_tokens, _step_kv_tokens_reference, run_decode_case
    from sparse_serve.config import EngineConfig
    from sparse_serve.engine import LLMEngine

    config = dict(QUERY_AWARE.get(method, {}), block_size=16, max_model_len=1024, num_kv_blocks=200)
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_MODEL), device="cpu", async_scheduling=True, **config))
    for n in (300, 17, 900):
        engine.add_synthetic_request(n, greedy(4, ignore_eos=True))
    assert _step_kv_tokens(engine) == _step_kv_tokens_reference(engine)
    for rid in list(engine._requests):
        engine.abort_request(rid)
    raw = run_decode_case(engine, DecodeCase(200, 2, 12, timed_steps=6), kv_bytes_per_slot=4, progress=False)
    assert raw["async_scheduling"] and raw["pipelined_steps"] > 0 and raw["wall_seconds"] > 0
    assert len(raw["step_seconds"]) == len(raw["step_end_unix"]) == 6
    assert engine.kv.pool.num_used_blocks == 0 and engine._inflight is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_pipelined_equal_synchronous(dtype):
    """On the GPU (graphs replayed, tokens fed on the device) the pipelined loop equals the
    synchronous one; fp32 also equals the CPU. In bf16 only batches that are identical in both loops
    are compared exactly (a dropped row changes the batch size, hence the split-K reduction)."""
    config = dict(device="cuda", dtype=dtype, block_size=16, max_model_len=512, num_kv_blocks=128)
    if dtype == "float32":
        ref = _reference_tokens(PROMPTS[0], 12)
        script = {
            0: [
                ("add", "stop", PROMPTS[0], greedy(20, ignore_eos=True, stop_token_ids=[ref[6]])),
                ("add", "len", PROMPTS[1], greedy(15, ignore_eos=True)),
                ("add", "abort", PROMPTS[2], greedy(30, ignore_eos=True)),
            ],
            3: [("add", "late", PROMPTS[3], greedy(10, ignore_eos=True))],
            8: [("abort", "abort")],
        }
    else:
        script = {0: [("add", f"r{i}", PROMPTS[i], greedy(16, ignore_eos=True)) for i in range(4)]}
    sync, pipelined, llm = both(script, **config)
    assert pipelined.tokens == sync.tokens and pipelined.final == sync.final
    assert llm.engine.num_pipelined_steps > 0 and llm.engine.runner.graphs.num_replays > 0
    if dtype == "float32":
        cpu = drive(LLM(str(DEFAULT_MODEL), async_scheduling=False, **(config | dict(device="cpu"))), script)
        assert cpu.tokens == pipelined.tokens


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("method", sorted(QUERY_AWARE))
def test_cuda_query_aware_pipelined_equal_cpu(method):
    script = {
        0: [("add", "a", LONG, greedy(10, ignore_eos=True)), ("add", "b", LONG[:200], greedy(7, ignore_eos=True))]
    }
    config = dict(dtype="float32", block_size=16, max_model_len=1024, num_kv_blocks=160, **QUERY_AWARE[method])
    cpu = drive(LLM(str(DEFAULT_MODEL), device="cpu", async_scheduling=False, **config), script)
    llm = LLM(str(DEFAULT_MODEL), device="cuda", async_scheduling=True, **config)
    gpu = drive(llm, script)
    assert gpu.tokens == cpu.tokens and llm.engine.num_pipelined_steps > 0


try:  # the GPU box runs this file without hypothesis: the random workloads then run on CPU CI only
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:
    st = None

if st is not None:

    @pytest.fixture(scope="module")
    def tiny(tiny_checkpoint):
        return str(tiny_checkpoint("qwen3")[0])

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_random_workloads_match(tiny, data):
        """Random arrivals, lengths, stop ids and aborts on a tiny model: the same outputs either way."""
        num = data.draw(st.integers(1, 5))
        script: dict[int, list[tuple]] = {}
        aborted = set()
        for i in range(num):
            prompt = data.draw(st.lists(st.integers(3, 383), min_size=1, max_size=24))
            stops = data.draw(st.lists(st.integers(3, 383), max_size=40))
            params = greedy(data.draw(st.integers(1, 12)), ignore_eos=True, stop_token_ids=stops)
            script.setdefault(data.draw(st.integers(0, 6)), []).append(("add", f"r{i}", prompt, params))
            if data.draw(st.booleans()) and data.draw(st.booleans()):
                script.setdefault(data.draw(st.integers(1, 10)), []).append(("abort", f"r{i}"))
                aborted.add(f"r{i}")
        block_size = data.draw(st.sampled_from([1, 4, 16]))
        config = dict(
            device="cpu",
            max_model_len=64,
            block_size=block_size,
            num_kv_blocks=-(-64 // block_size) + data.draw(st.integers(0, 64 // block_size)),  # small pools preempt
            max_num_batched_tokens=data.draw(st.sampled_from([8, 64])),
            enable_prefix_caching=data.draw(st.booleans()),
        )
        sync = drive(LLM(tiny, async_scheduling=False, **config), script)
        pipelined = drive(LLM(tiny, async_scheduling=True, **config), script)
        for rid in {*sync.tokens, *pipelined.tokens}:
            a, b = sync.tokens.get(rid, []), pipelined.tokens.get(rid, [])
            if rid in aborted:  # a late arrival may be one call behind when the abort comes
                n = min(len(a), len(b))
                assert a[:n] == b[:n]
            else:
                assert a == b and sync.final[rid] == pipelined.final[rid]
