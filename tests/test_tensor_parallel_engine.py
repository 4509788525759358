"""Tensor-parallel engine: 2 and 4 gloo ranks (CPU, fp32; ``LLM`` starts the ranks) give the greedy
tokens of one rank for a dense (Qwen3: KV heads split at 2 ranks, replicated at 4) and a MoE model
(Qwen3-MoE), and at 2 ranks for the MLA models (DeepSeek-V2; GLM-4.7-Flash dense only: heads split,
the latent whole on every rank), with dense attention, SnapKV (evicting) and Quest (selecting pages).
The 2-rank Qwen3 cases and DeepSeek-V2 with SnapKV run by default; the rest of the matrix is slow."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import family_config

from sparse_serve import LLM, SamplingParams

METHODS = {
    "dense": {},
    # Budgets well under the 40-token prompt: SnapKV evicts, Quest reads a few pages.
    "snapkv": dict(sink_keep_tokens=2, decode_keep_tokens=8, recent_keep_tokens=8, observation_window_size=4),
    "quest": dict(
        sink_keep_tokens=4, decode_keep_tokens=8, recent_keep_tokens=4, quest_chunk_size=4, quest_skip_layers=0
    ),
}
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def make(family: str) -> str:
        if family not in made:
            config, model_cls = family_config(family)
            torch.manual_seed(0)
            made[family] = str(tmp_path_factory.mktemp(family))
            model_cls(config).save_pretrained(made[family])
        return made[family]

    return make


def _greedy(path: str, world: int, method: str) -> list[tuple[int, ...]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 40, 23)]
    llm = LLM(path, device="cpu", block_size=4, tensor_parallel_size=world, sparse_method=method, **METHODS[method])
    try:
        return [out.token_ids for out in llm.generate(prompts, PARAMS)]
    finally:
        llm.close()


CASES = (
    [
        pytest.param(family, world, method, marks=() if (family, world) == ("qwen3", 2) else pytest.mark.slow)
        for family in ("qwen3", "qwen3_moe")
        for world in (2, 4)
        for method in METHODS
    ]
    + [  # MLA: heads split, the latent whole on every rank
        pytest.param("deepseek_v2", 2, method, marks=() if method == "snapkv" else pytest.mark.slow)
        for method in METHODS
    ]
    + [pytest.param("glm4_moe_lite", 2, "dense", marks=pytest.mark.slow)]
)


@pytest.mark.parametrize(("family", "world", "method"), CASES)
def test_ranks_give_one_ranks_tokens(checkpoint, family, world, method):
    path = checkpoint(family)
    expected = _greedy(path, 1, method)
    if method != "dense":  # the method really changes what is read
        assert expected != _greedy(path, 1, "dense")
    assert _greedy(path, world, method) == expected


def test_method_without_tensor_parallel_is_an_error(checkpoint):
    with pytest.raises(ValueError, match="h2o does not support tensor_parallel_size"):
        LLM(checkpoint("qwen3"), device="cpu", tensor_parallel_size=2, sparse_method="h2o")
