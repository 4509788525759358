"""Qwen3-MoE in the engine on a CUDA device (fused_moe's Triton path inside decode CUDA graphs) gives
what eager steps give, and HF's tokens (skipped without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import hf_greedy

from sparse_serve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_NEW = 10


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 23, 1, 40, 17, 9)]


def _greedy(path, **config) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, **config)
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    if not config.get("enforce_eager"):
        assert llm.engine.runner.graphs.num_replays > 0, "decode steps should replay CUDA graphs"
    return [list(o.token_ids) for o in outs]


def test_moe_graphs_equal_eager_and_hf(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("qwen3_moe")
    graphs = _greedy(path)
    assert graphs == _greedy(path, enforce_eager=True)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in _prompts()]
    # fp32 on both sides, but GPU sums run in other orders: the first tokens must agree.
    assert [g[:3] for g in graphs] == [e[:3] for e in expected]
