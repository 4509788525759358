"""Tensor-parallel decode under CUDA graphs on 2 CUDA devices (NCCL collectives captured on each rank):
2 ranks with graphs give the tokens of the same 2 ranks decoding eagerly, and rank 0 replays graphs,
for a GQA model (Qwen3: KV heads split), a MoE model (Qwen3-MoE) and the MLA models (DeepSeek-V2,
GLM-4.7-Flash: the latent whole on every rank), with dense attention and SnapKV (evicting), and Quest
on Qwen3 (selecting graphs, captured lazily at the same step on every rank); OmniKV (its filter
layers' max over heads an NCCL all-reduce inside the selecting graphs), H2O and TOVA (scores summed
over the ranks) on Qwen3. fp32; skipped with fewer than 2 CUDA devices."""

from __future__ import annotations

import random

import pytest
import torch
from test_tensor_parallel_engine import METHODS, PARAMS, checkpoint  # noqa: F401 (the fixture)

from sparse_serve import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _greedy(path: str, method: str, **config) -> tuple[list[tuple[int, ...]], int]:
    """Two ranks' tokens and rank 0's graph replays (-1: no graphs)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 40, 23)]
    llm = LLM(
        path, device="cuda", dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=4,
        tensor_parallel_size=2, sparse_method=method, **METHODS[method], **config,
    )  # fmt: skip
    try:
        tokens = [out.token_ids for out in llm.generate(prompts, PARAMS)]
        graphs = llm.engine.runner.graphs
        return tokens, -1 if graphs is None else graphs.num_replays
    finally:
        llm.close()


CASES = [
    (family, method)
    for family in ("qwen3", "qwen3_moe", "deepseek_v2", "glm4_moe_lite")
    for method in ("dense", "snapkv")
] + [("qwen3", method) for method in ("quest", "omnikv", "h2o", "tova")]


@pytest.mark.parametrize(("family", "method"), CASES)
def test_two_ranks_graphs_equal_eager(checkpoint, family, method):  # noqa: F811
    path = checkpoint(family)
    graphed, replays = _greedy(path, method)
    eager, none = _greedy(path, method, enforce_eager=True)
    # Selecting or compacting steps may all run eagerly (Quest: rows that select unlike are eager).
    assert none == -1 and (replays > 0 or method not in ("dense", "snapkv"))
    assert graphed == eager
