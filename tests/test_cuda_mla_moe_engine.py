"""MLA models with routed experts on a CUDA device: the latent Triton kernels (split-K decode with the
Triton merge) and fused_moe give HF's first tokens (fp32; skipped without CUDA), and decode under CUDA
graphs (the latent decode plan in fixed buffers) gives the eager engine's tokens for dense attention
and eviction methods that compact the latents (SnapKV, StreamingLLM at small budgets; H2O observes
every decode step, so its steps stay eager) and for Quest on the latent (selecting graphs)."""

from __future__ import annotations

import pytest
import torch
from test_mla_engine import MAX_NEW, _prompts, mla_checkpoint  # noqa: F401 (the fixture)
from tiny_models import hf_greedy

from sparse_serve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Budgets under the 40-token prompt, so the methods evict while the graphs replay.
SMALL_BUDGETS = {
    "dense": {},
    "snapkv": dict(
        sparse_method="snapkv",
        sink_keep_tokens=2,
        decode_keep_tokens=8,
        recent_keep_tokens=8,
        observation_window_size=4,
    ),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=16, h2o_decode_budget=16, decode_eviction_interval=4),
    "streamingllm": dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=12),
}

# H2O observes every decode step's attention: eager steps (0 replays).
NO_REPLAY = {"h2o": 0}
QUEST = dict(
    sparse_method="quest",
    sink_keep_tokens=4,
    decode_keep_tokens=8,
    recent_keep_tokens=4,
    quest_chunk_size=4,
    quest_skip_layers=0,
)


def _run(path, prompts, **config):
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=4, num_kv_blocks=128, **config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    return [list(o.token_ids) for o in outs], llm.engine.runner.graphs


def _greedy(path, prompts, **config) -> tuple[list[list[int]], int]:
    """Tokens and how many decode steps replayed a graph (-1: no graphs)."""
    tokens, graphs = _run(path, prompts, **config)
    return tokens, -1 if graphs is None else graphs.num_replays


@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_mla_moe_on_cuda_equals_hf(mla_checkpoint, name):  # noqa: F811
    path, hf_model = mla_checkpoint(name)
    prompts = _prompts(seed=3)
    ours, replays = _greedy(path, prompts)
    assert replays > 0, "MLA decode steps should replay CUDA graphs"
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    # fp32 on both sides, but GPU sums run in other orders: the first tokens must agree.
    assert [g[:3] for g in ours] == [e[:3] for e in expected]


@pytest.mark.parametrize("method", SMALL_BUDGETS)
@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_mla_decode_graphs_equal_eager(mla_checkpoint, name, method):  # noqa: F811
    path, _ = mla_checkpoint(name)
    prompts = _prompts(seed=7)
    graphed, replays = _greedy(path, prompts, **SMALL_BUDGETS[method])
    eager, none = _greedy(path, prompts, enforce_eager=True, **SMALL_BUDGETS[method])
    assert none == -1
    assert graphed == eager  # the same kernels and plans, replayed: the same tokens
    if method in NO_REPLAY:
        assert replays == NO_REPLAY[method]
    else:
        assert replays > 0


@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_mla_quest_selecting_graphs_equal_eager(mla_checkpoint, name):  # noqa: F811
    """Every prompt outgrows Quest's 16-token budget, so every decode row selects 4 pages: the steps
    replay selecting graphs (picks written into the latent plan on the device) with eager's tokens."""
    path, _ = mla_checkpoint(name)
    prompts = _prompts(seed=7, shared_prefix=20)
    graphed, graphs = _run(path, prompts, **QUEST)
    assert graphs.selecting_graphs and graphs.num_replays > 0
    assert graphed == _run(path, prompts, enforce_eager=True, **QUEST)[0]
