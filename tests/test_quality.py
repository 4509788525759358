"""Dense retrieval quality of the embedded trained model through the engine (CPU).

A regression in attention, paging, chunked prefill or prefix caching shows up here as lost needles
long before it shows up in token-level parity on tiny random models.
"""

from __future__ import annotations

import pytest
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM
from sparse_serve.eval.harness import EvalGrid, make_samples, run_eval, summarize
from sparse_serve.eval.tasks import Haystack


@pytest.fixture(scope="module")
def haystack():
    return Haystack.from_stdlib(max_chars=1_000_000)


def test_dense_single_key_retrieval_with_chunked_prefill(haystack):
    llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=4096, max_num_batched_tokens=512)
    grid = EvalGrid(("niah_single",), (512, 2048), (0.0, 0.5, 1.0), samples_per_cell=2, seed=5)
    summary = summarize(run_eval(llm, make_samples(grid, llm.tokenizer, haystack), progress=False))
    assert summary["accuracy"] >= 0.9, summary["per_cell"]
    assert llm.engine.prefix_hit_tokens > 0  # the shared task header is served from the prefix cache
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_dense_multikey_and_multiturn(haystack):
    llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=2048, block_size=1)
    grid = EvalGrid(("niah_multikey", "multiturn_recall"), (1024,), (0.25, 0.75), samples_per_cell=2, seed=6)
    summary = summarize(run_eval(llm, make_samples(grid, llm.tokenizer, haystack), progress=False))
    assert summary["accuracy"] >= 0.75, summary["per_cell"]
