"""The engine on a CUDA device gives what its CPU reference path gives (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["def parse(text):", "Return the number of", "class Queue:", "x" * 3]


def _greedy(device: str, dtype: str, **config) -> list[tuple[int, ...]]:
    llm = LLM(
        str(DEFAULT_MODEL), device=device, dtype=dtype, block_size=16, max_model_len=512, num_kv_blocks=64, **config
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    observes_decode = config.get("sparse_method") == "h2o"  # H2O scores every decode step: eager steps
    if device == "cuda" and not config.get("enforce_eager") and not observes_decode:
        assert llm.engine.runner.graphs.num_replays > 0, "decode steps should replay CUDA graphs"
    return [o.token_ids for o in outs]


def test_cuda_graphs_equal_eager_fp32():
    assert _greedy("cuda", "float32") == _greedy("cuda", "float32", enforce_eager=True)


def test_cuda_graphs_with_staggered_batches():
    """Requests join and leave mid-generation, so decode batches change size (a graph per size up to 8)."""
    llm = LLM(str(DEFAULT_MODEL), device="cuda", dtype="float32", max_model_len=512, num_kv_blocks=128)
    ref = LLM(str(DEFAULT_MODEL), device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=128)
    prompts = [f"def f{i}(x):" * (1 + i % 3) for i in range(7)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(7)]
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [o.token_ids for o in ref.generate(prompts, params)]
    assert llm.engine.runner.graphs.num_replays > 0


@pytest.mark.parametrize("method", ["snapkv", "streamingllm", "h2o", "pyramidkv"])
def test_eviction_methods_on_cuda_equal_cpu(method):
    """PyramidKV (no decode eviction) keeps a table per layer: its decode steps replay graphs of one group per layer."""
    small = {
        "snapkv": dict(sink_keep_tokens=4, decode_keep_tokens=8, recent_keep_tokens=8, observation_window_size=4),
        "pyramidkv": dict(
            sink_keep_tokens=4,
            decode_keep_tokens=8,
            recent_keep_tokens=8,
            observation_window_size=4,
            pyramidkv_beta=2.0,
            decode_eviction_interval=0,
        ),
        "streamingllm": dict(sink_keep_tokens=4, recent_keep_tokens=8, decode_eviction_interval=4),
        "h2o": dict(h2o_prefill_budget=12, h2o_decode_budget=10, decode_eviction_interval=4),
    }[method]
    cfg = dict(sparse_method=method, **small)
    assert _greedy("cuda", "float32", **cfg) == _greedy("cpu", "float32", **cfg)


def test_cuda_fp32_equals_cpu_fp32():
    assert _greedy("cuda", "float32") == _greedy("cpu", "float32")


def test_cuda_bf16_mostly_agrees_with_cpu_fp32():
    ref, got = _greedy("cpu", "float32"), _greedy("cuda", "bfloat16")
    # bf16 drifts after the first disagreement; count agreement up to it, per prompt.
    agree = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        for r, g in zip(ref, got, strict=True)
    ]
    assert sum(agree) / sum(len(r) for r in ref) >= 0.5, agree


def test_fused_decode_projections_mostly_agree_with_unfused(monkeypatch):
    """bf16 decode batches run the projections with the residual add, norms and SiLU*mul in their epilogues
    (``linear_epilogue``), under CUDA graphs; they agree with the separate launches up to bf16 rounding."""
    from sparse_kernels import linear_epilogue

    fused = _greedy("cuda", "bfloat16")
    monkeypatch.setattr(linear_epilogue, "ENABLED", False)
    plain = _greedy("cuda", "bfloat16")
    agree = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        for r, g in zip(plain, fused, strict=True)
    ]
    assert sum(agree) / sum(len(r) for r in plain) >= 0.75, agree


@pytest.mark.parametrize("method", ["quest", "omnikv"])
def test_query_aware_methods_on_cuda_equal_cpu(method):
    """Both select on the device on CUDA (Triton: Quest's page bounds and top-k; OmniKV's filter-layer logits,
    attention from them and token set); both equal the CPU path."""
    cfg = dict(sparse_method=method, sink_keep_tokens=16, decode_keep_tokens=32, recent_keep_tokens=16)
    prompts = ["def parse(text):" * 25, "Return the number of" * 20]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(device):
        llm = LLM(str(DEFAULT_MODEL), device=device, dtype="float32", max_model_len=512, num_kv_blocks=64, **cfg)
        out = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.runner.attention.selective.num_selections > 0
        return out

    assert run("cuda") == run("cpu")


@pytest.mark.parametrize("method", ["quest", "omnikv"])
def test_selecting_decode_steps_replay_cuda_graphs(method):
    """Steps where every request selects are captured (per bucket and selection) and replayed, with
    block summaries updated inside the graph; tokens equal eager steps and the CPU path."""
    cfg = dict(sparse_method=method, sink_keep_tokens=16, decode_keep_tokens=32, recent_keep_tokens=16)
    prompts = ["def parse(text):" * 25, "Return the number of" * 20, "class Queue:" * 30]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(device, **kw):
        llm = LLM(str(DEFAULT_MODEL), device=device, dtype="float32", max_model_len=512, num_kv_blocks=96, **cfg, **kw)
        return llm, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    graphed, got = run("cuda")
    graphs = graphed.engine.runner.graphs
    assert graphs.selecting_graphs, "uniform selecting steps should be captured"
    assert graphs.num_replays >= 16
    assert got == run("cuda", enforce_eager=True)[1] == run("cpu")[1]
