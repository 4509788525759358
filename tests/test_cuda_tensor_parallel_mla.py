"""MLA models under tensor parallelism on 2 CUDA devices (NCCL, rank r on cuda:r): 2 ranks give the
first greedy tokens of one rank for DeepSeek-V2 and GLM-4.7-Flash with dense attention, SnapKV and
Quest, through the latent Triton kernels (fp32; skipped with fewer than 2 CUDA devices). The
reductions sum in another order than one rank's matmuls, so the first tokens must agree."""

from __future__ import annotations

import pytest
import torch
from test_mla_engine import _prompts, mla_checkpoint  # noqa: F401 (the fixture)
from test_tensor_parallel_engine import METHODS

from sparse_serve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _greedy(path, world: int, method: str) -> list[list[int]]:
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        tensor_parallel_size=world,
        sparse_method=method,
        **METHODS[method],
    )
    try:
        outs = llm.generate(_prompts(seed=3), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        return [list(o.token_ids) for o in outs]
    finally:
        llm.close()


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_two_gpus_give_one_gpus_tokens(mla_checkpoint, name, method):  # noqa: F811
    path, _ = mla_checkpoint(name)
    expected = _greedy(path, 1, method)
    assert [g[:3] for g in _greedy(path, 2, method)] == [e[:3] for e in expected]
