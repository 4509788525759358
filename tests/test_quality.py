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


def test_methods_are_told_apart_at_a_quarter_budget(haystack):
    """StreamingLLM with a small window loses needles in the middle; SnapKV with the question inside its
    observation window stays near dense at a 25% budget (1024-token contexts, 256-token budget)."""
    grid = EvalGrid(("niah_single",), (1024,), (0.5,), samples_per_cell=4, seed=11)

    def accuracy(**method) -> float:
        llm = LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=1100, max_num_batched_tokens=512, **method)
        summary = summarize(run_eval(llm, make_samples(grid, llm.tokenizer, haystack), progress=False))
        assert llm.engine.kv.pool.num_used_blocks == 0
        return summary["accuracy"]

    dense = accuracy()
    streaming = accuracy(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=252)
    snapkv = accuracy(
        sparse_method="snapkv",
        sink_keep_tokens=4,
        recent_keep_tokens=32,
        observation_window_size=32,
        decode_keep_tokens=220,
    )
    assert dense >= 0.75
    assert streaming <= 0.25
    assert snapkv >= dense - 0.25 and snapkv > streaming
