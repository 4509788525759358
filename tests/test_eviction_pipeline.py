"""Evicting methods in the pipelined decode loop, with decode-time eviction (issue 15 item 5).

Decode steps of every evicting method are pipelined, the compaction at each method's interval
included: its new lengths and freed blocks are known on the host, its kept indices stay on the
device. Window scorers remember their decode queries in the engine's query ring, and H2O adds the
decode kernel's score output to running sums, both inside the step (so the steps between
compactions replay CUDA graphs), instead of handing every step's queries and keys to the host path.
On CPU: the device state gives what the host path gives, and the pipelined loop what the
synchronous one gives (CUDA graphs: see the GPU test at the end).
"""

from __future__ import annotations

import random

import pytest
import torch
from test_async_scheduling import drive, greedy
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM

_rng = random.Random(15)
PROMPTS = [[_rng.randrange(3, 4000) for _ in range(n)] for n in (60, 45, 70, 9)]

# Small budgets and intervals, so that prompts and decodes compact several times.
DECODE_EVICTING = {
    "snapkv": dict(sparse_method="snapkv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=16)
    | dict(observation_window_size=8, decode_eviction_interval=5),
    "pyramidkv": dict(sparse_method="pyramidkv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=16)
    | dict(observation_window_size=8, decode_eviction_interval=7),
    "rkv": dict(sparse_method="rkv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=8)
    | dict(rkv_compression_interval=6, rkv_observation_tokens=3),
    "skipkv": dict(sparse_method="skipkv", sink_keep_tokens=4, decode_keep_tokens=20, recent_keep_tokens=8)
    | dict(skipkv_compression_interval=6, skipkv_redundancy_window=8, skipkv_segment_size=4),
    "tova": dict(sparse_method="tova", decode_keep_tokens=30, decode_eviction_interval=3),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=30, h2o_decode_budget=24, h2o_prefill_score_window=8)
    | dict(decode_eviction_interval=5),
    "h2o_per_head": dict(sparse_method="h2o", h2o_prefill_budget=30, h2o_decode_budget=24, h2o_per_head=True)
    | dict(decode_eviction_interval=4),
    "streamingllm": dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=20)
    | dict(decode_eviction_interval=5),
}
RING_METHODS = ("snapkv", "pyramidkv", "rkv", "tova", "skipkv")
SUMS_METHODS = ("h2o", "h2o_per_head")
CONFIG = dict(device="cpu", max_model_len=256, block_size=8, max_num_batched_tokens=32)


def _llm(method: str, on_device: bool = True, **config) -> LLM:
    llm = LLM(str(DEFAULT_MODEL), **(CONFIG | DECODE_EVICTING[method] | config))
    engine = llm.engine
    assert (engine.runner.query_ring is not None) == (method in RING_METHODS)
    assert (engine.runner.score_sums is not None) == (method in SUMS_METHODS)
    if not on_device:  # the host path: every decode step hands its queries and keys to on_attention_end
        engine.method.query_ring = engine.runner.attention.query_ring = None
        engine.method.decode_score_sums = engine.runner.attention.score_sums = None
    return llm


def _script() -> dict[int, list[tuple]]:
    return {
        0: [
            ("add", "a", PROMPTS[0], greedy(24, ignore_eos=True)),
            ("add", "b", PROMPTS[1], greedy(17, ignore_eos=True)),
            ("add", "x", PROMPTS[3], greedy(40, ignore_eos=True)),
        ],
        5: [("add", "c", PROMPTS[2], greedy(19, ignore_eos=True))],
        9: [("abort", "x")],
    }


def _spy(llm: LLM, name: str) -> list:
    """Calls of the engine's method's ``name`` from now on: (arguments, result) pairs."""
    method, calls = llm.engine.method, []
    hook = getattr(method, name)

    def spied(*args):
        out = hook(*args)
        calls.append((tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), out))
        return out

    setattr(method, name, spied)
    return calls


@pytest.mark.parametrize("method", RING_METHODS + SUMS_METHODS)
def test_device_observation_equals_the_host_path(method):
    """Recording decode queries in the ring (folded in at the compactions), or adding the decode kernel's
    scores to running sums, keeps what handing every step's queries and keys to the host path keeps: the
    same tokens, the same scores at every compaction and the same state a chain saves, with the method
    observing only the steps that compact."""
    script = _script()
    script[0].append(("add", "t", PROMPTS[2], greedy(12, ignore_eos=True), {"chain_id": "c"}))
    traces, saved, ranked, observed = [], [], [], []
    for on_device in (True, False):
        llm = _llm(method, on_device)
        llm.engine.method.batches_compactions = False  # each compaction's scores through _select (batched: elsewhere)
        releases, views, selects = (_spy(llm, name) for name in ("release", "on_attention_end", "_select"))
        traces.append(drive(llm, script, chains=("c",)))
        (state,) = [out for (rid,), out in releases if rid == "t"]  # what the chain keeps of request t
        saved.append(state.scores if method in SUMS_METHODS else state.window)
        ranked.append([args[0] for args, _ in selects])
        observed.append(sum(len(batch) for (_, batch), _ in views))  # (request, layer) observations
    assert traces[0].tokens == traces[1].tokens and traces[0].final == traces[1].final
    assert len(ranked[0]) == len(ranked[1]) > 0
    for a, b in zip(*ranked, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    if method in SUMS_METHODS:  # summed in another order: equal up to rounding
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*saved, strict=True))
    else:
        assert all(torch.equal(a, b) for a, b in zip(*saved, strict=True))
        assert saved[0][0].shape[0] == DECODE_EVICTING[method].get(
            "observation_window_size", 3 if method == "rkv" else 1
        )
    assert observed[0] < observed[1] / 2


def test_score_sums_too_wide_a_step_takes_the_host_path():
    """A step whose rows' scores would not fit the sums' buffer (a long prompt's last token as a one-token
    row beside the decodes) hands its decodes to the host path; the tokens stay those of the host path."""
    long_prompt = [_rng.randrange(3, 4000) for _ in range(91)]  # six chunks of 15 beside a decode, then one token
    script = {0: [("add", "a", PROMPTS[3], greedy(30, ignore_eos=True))], 4: [("add", "b", long_prompt, greedy(8))]}
    traces, overflows = [], []
    for on_device in (True, False):
        llm = _llm("h2o", on_device, max_num_seqs=2, max_num_batched_tokens=16)
        sums = llm.engine.runner.score_sums
        if sums is not None:
            sums.fits = lambda kv_lens, fits=sums.fits: overflows.append(not fits(kv_lens)) or fits(kv_lens)
        traces.append(drive(llm, script))
    assert traces[0].tokens == traces[1].tokens and any(overflows) and not all(overflows)


@pytest.mark.parametrize("method", sorted(DECODE_EVICTING))
def test_decode_eviction_pipelines_and_matches_the_synchronous_loop(method):
    """Decode steps are pipelined, those that compact included: the same outputs as the synchronous loop."""
    sync = drive(_llm(method, async_scheduling=False), _script())
    llm = _llm(method, async_scheduling=True)
    compactions = _spy(llm, "finish_step")
    pipelined = drive(llm, _script())
    assert pipelined.tokens == sync.tokens and pipelined.final == sync.final
    assert llm.engine.num_pipelined_steps > 15
    decode_compactions = sum(len(out) for _, out in compactions[5:])  # past the prompts
    assert decode_compactions >= 3


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("method", sorted(DECODE_EVICTING))
def test_cuda_decode_eviction_graphs_pipelined_equal_synchronous(method):
    """On the GPU in fp32: pipelined with CUDA graphs (the steps between compactions replay, the ring
    written inside them) == synchronous eager == the CPU."""
    gpu = dict(device="cuda", dtype="float32", num_kv_blocks=128)
    eager = drive(_llm(method, async_scheduling=False, enforce_eager=True, **gpu), _script())
    llm = _llm(method, async_scheduling=True, **gpu)
    graphed = drive(llm, _script())
    cpu = drive(_llm(method, async_scheduling=False, dtype="float32"), _script())
    assert graphed.tokens == eager.tokens == cpu.tokens and graphed.final == eager.final
    assert llm.engine.num_pipelined_steps > 15
    assert llm.engine.runner.graphs.num_replays > 0
