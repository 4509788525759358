"""MLA models with routed experts on a CUDA device: the latent Triton kernels (split-K decode with the
Triton merge) and fused_moe give HF's first tokens (fp32; skipped without CUDA). MLA decode is not
captured in CUDA graphs yet (the latent plans are not in fixed buffers): the test holds that too, so
it changes when graphs land."""

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


def _greedy(path, prompts) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert llm.engine.runner.graphs is None, "MLA decode captured in CUDA graphs: test graphs == eager here"
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_mla_moe_on_cuda_equals_hf(mla_checkpoint, name):  # noqa: F811
    path, hf_model = mla_checkpoint(name)
    prompts = _prompts(seed=3)
    ours = _greedy(path, prompts)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    # fp32 on both sides, but GPU sums run in other orders: the first tokens must agree.
    assert [g[:3] for g in ours] == [e[:3] for e in expected]
