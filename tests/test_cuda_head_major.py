"""The head-major store on a CUDA device (skipped without CUDA): AdaKV's ragged per-head decode through
the Triton kernels (a row per (request, KV head), each lane its own block list) under CUDA graphs
generates what a plain per-head-masked HF decode over the kept sets generates, and what the eager and
CPU reference paths generate, in batches that mix prefill chunks and decodes; KVzip's likewise."""

from __future__ import annotations

import pytest
import torch
from test_adakv import _kvpress_params, _masked_decode_reference, _prompt, head_kept
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _llm(path, device: str, **params) -> LLM:
    # A fixed pool: sized by free GPU memory, a second engine in the same test would find none left.
    base = dict(device=device, dtype="float32", block_size=16, max_num_batched_tokens=4096, enforce_eager=False)
    base["num_kv_blocks"] = 2048
    return LLM(str(path), **{**base, **params})


def test_ragged_decode_on_cuda_equals_the_masked_reference(tiny_checkpoint):
    path, model = tiny_checkpoint("llama")
    prompt = _prompt(5)
    params = dict(sparse_method="adakv", **_kvpress_params(60, 16, 0.2))
    engine = _llm(path, "cuda", **params).engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    kept = head_kept(engine, rid, model, prompt)
    engine.abort_request(rid)
    assert any(len({len(s) for s in layer}) > 1 for layer in kept)  # ragged
    llm = _llm(path, "cuda", **params)
    out = llm.generate([prompt], GREEDY)[0]
    assert list(out.token_ids) == _masked_decode_reference(model, prompt, kept, GREEDY.max_tokens)
    assert llm.engine.runner.graphs.num_replays > 0, "head-major decode steps should replay CUDA graphs"


@pytest.mark.parametrize("method", ["adakv", "kvzip"])
def test_head_major_batches_on_cuda_equal_cpu(tiny_checkpoint, method):
    """Several prompts, chunked prefill beside decodes: CUDA (Triton) equals CPU (references)."""
    if method == "adakv":
        path, params = tiny_checkpoint("llama")[0], dict(sparse_method="adakv", **_kvpress_params(40, 8, 0.2))
    else:
        path = DEFAULT_MODEL
        params = dict(
            sparse_method="kvzip", kvzip_token_budget=40, kvzip_score_chunk_size=40, kvzip_prev_postfix_size=8
        )
    prompts = [_prompt(seed, n) for seed, n in ((1, 90), (2, 130), (3, 61))]
    params = dict(params, max_num_batched_tokens=64)
    graphs = _llm(path, "cuda", **params)
    cuda = [o.token_ids for o in graphs.generate(prompts, GREEDY)]
    assert graphs.engine.runner.graphs.num_replays > 0
    assert cuda == [o.token_ids for o in _llm(path, "cuda", **params, enforce_eager=True).generate(prompts, GREEDY)]
    assert cuda == [o.token_ids for o in _llm(path, "cpu", **params).generate(prompts, GREEDY)]
