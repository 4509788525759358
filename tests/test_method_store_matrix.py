"""Every registered method over every compressed KV store, on CPU: a combination either generates (its budget
below the prompts, so the method acts; every token produced, every block and tail row given back) or is
refused when the engine is built, with a ValueError naming what is not built. Nothing starts that fails later.
A method registered without a small-budget setting here fails the test (add it to ``SETTINGS``)."""

from __future__ import annotations

import pytest
import torch

import sparse_methods
from sparse_serve import LLM, SamplingParams

# Budgets under the prompts (150 and 90 tokens), in the vocabulary of each method.
PROTECTED = dict(sink_keep_tokens=4, recent_keep_tokens=16)
SETTINGS = {
    "dense": {},
    "streamingllm": dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=36),
    "snapkv": dict(sparse_method="snapkv", **PROTECTED, decode_keep_tokens=20, observation_window_size=8),
    "pyramidkv": dict(sparse_method="pyramidkv", **PROTECTED, decode_keep_tokens=36, observation_window_size=8),
    "adakv": dict(sparse_method="adakv", **PROTECTED, decode_keep_tokens=20, observation_window_size=8),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=40, h2o_decode_budget=24, decode_eviction_interval=3),
    "tova": dict(sparse_method="tova", decode_keep_tokens=40, decode_eviction_interval=2),
    "rkv": dict(
        sparse_method="rkv", **PROTECTED, decode_keep_tokens=32, rkv_compression_interval=3, rkv_observation_tokens=3
    ),
    "skipkv": dict(sparse_method="skipkv", **PROTECTED, decode_keep_tokens=28, skipkv_compression_interval=3),
    "kvzip": dict(sparse_method="kvzip", kvzip_token_budget=48),
    "quest": dict(sparse_method="quest", sink_keep_tokens=16, decode_keep_tokens=32, recent_keep_tokens=16),
    "omnikv": dict(sparse_method="omnikv", **PROTECTED, decode_keep_tokens=32, full_attention_layers="1"),
    "retroinfer": dict(sparse_method="retroinfer", retroinfer_min_index_tokens=64, retroinfer_update_tokens=32),
    "fp8_kv": dict(sparse_method="fp8_kv"),
    "kivi": dict(sparse_method="kivi"),
    "turboquant": dict(sparse_method="turboquant"),
}
STORES = {"fp8": dict(kv_cache_dtype="fp8"), "kivi": dict(kv_cache_dtype="kivi"), "turboquant": {}}
STORES["turboquant"] = dict(kv_cache_dtype="turboquant", turboquant_bits=3)
# Not built yet, refused at start-up: (method, store) -> what the error says.
REFUSED = {
    **{(m, s): "head-major store in the model dtype" for m in ("adakv", "kvzip") for s in STORES},
    **{("retroinfer", s): "from keys or history" for s in STORES},
    ("omnikv", "kivi"): "from keys or history",
    # a compressed-storage method names its own store
    **{(m, s): "contradicts" for m in ("fp8_kv", "kivi", "turboquant") for s in STORES if not m.startswith(s[:3])},
}
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3")[0]


def test_every_registered_method_has_a_setting():
    assert set(sparse_methods.method_names()) <= set(SETTINGS), "add the new method to SETTINGS"


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_method_over_store_generates_or_is_refused_at_start_up(qwen3, method, store):
    config = dict(device="cpu", dtype="float32", max_num_batched_tokens=48, max_num_seqs=4, block_size=16)
    config.update(SETTINGS[method], **STORES[store])
    refused = REFUSED.get((method, store))
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            LLM(str(qwen3), **config)
        return
    llm = LLM(str(qwen3), **config)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (150, 90)]
    outs = llm.generate(prompts, PARAMS)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert all(0 not in o.token_ids for o in outs)  # greedy over NaN logits gives token 0
    engine = llm.engine
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.runner.tail_rows is None or engine.runner.tail_rows.held() == {}
