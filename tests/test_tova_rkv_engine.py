"""TOVA and R-KV end to end on CPU (tiny random Llama): TOVA's kept sets after a prefill equal kvpress's
TOVAPress; both evict during decode identically in the engine and in HF ``generate`` through
``sparse_methods.hf.SparseKVCache``; both run over an fp8 KV store and give its blocks back. (Budgets
above the context, memory within the plan under continuous batching and chain resume are in the
tables of test_methods_engine.py and test_chain_cache_engine.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from test_method_oracles import PROMPT_LEN, _engine_kept, _kvpress_kept, _prompt

from sparse_methods.hf import SparseKVCache
from sparse_serve import LLM, SamplingParams

NEW_TOKENS = 24
DECODE_EVICTING = {
    "tova": dict(decode_keep_tokens=35),  # every generated token evicts one
    "rkv": dict(
        sink_keep_tokens=0,
        decode_keep_tokens=32,
        recent_keep_tokens=8,
        rkv_compression_interval=6,
        rkv_observation_tokens=4,
    ),
    "skipkv": dict(
        sink_keep_tokens=4,
        decode_keep_tokens=28,
        recent_keep_tokens=8,
        skipkv_compression_interval=6,
        skipkv_redundancy_window=8,
        skipkv_segment_size=4,
    ),
}


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_tova_matches_kvpress(llama, ratio):
    """kvpress's TOVAPress: the last query's attention averaged over every head, its own token kept."""
    from kvpress import TOVAPress

    path, model = llama
    prompt = _prompt(6)
    n_kept = int(PROMPT_LEN * (1 - ratio))
    ours = _engine_kept(path, model, prompt, sparse_method="tova", decode_keep_tokens=n_kept - 1)
    assert ours == _kvpress_kept(model, prompt, TOVAPress(compression_ratio=ratio))
    assert all(layer[0] == layer[1] and len(layer[0]) == n_kept for layer in ours)  # one set per layer
    assert ours[0][0] != set(range(PROMPT_LEN - n_kept, PROMPT_LEN))  # not just the recent tokens


def _engine_generate(path, prompt, method, **kw):
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=4096, **kw)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return list(llm.generate([prompt], params)[0].token_ids)


@pytest.mark.parametrize("method", sorted(DECODE_EVICTING))
def test_hf_generate_equals_engine(llama, method):
    path, model = llama
    params = DECODE_EVICTING[method]
    prompt = _prompt(7, 60)
    with SparseKVCache(model, method, **params) as cache, torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    ours = out[0, len(prompt) :].tolist()
    assert ours == _engine_generate(path, prompt, method, sparse_method=method, **params)
    assert cache.num_tokens == 60 + NEW_TOKENS - 1
    assert max(cache.kv_lens()) <= 40 + (1 if method == "tova" else 6)  # evicted during decode


@pytest.mark.parametrize("method", sorted(DECODE_EVICTING))
def test_runs_over_fp8_and_gives_blocks_back(llama, method):
    """Over an fp8 store: the cache is cut back to the budget (the request holds fewer slots than its
    tokens), the pool holds exactly the request's blocks at every step, and all of them come back."""
    path, _ = llama
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=32,
        kv_cache_dtype="fp8",
        sparse_method=method,
        **DECODE_EVICTING[method],
    )
    engine = llm.engine
    rid = engine.add_request(_prompt(8, 90), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        req = engine._requests.get(rid)
        if req is not None and engine.kv.has_request(rid):
            assert engine.kv.pool.num_used_blocks == math.ceil(req.kv_len / 8)
            held.append(max(req.kv_lens))
    assert min(held) <= 40 < 90 and max(held) <= 90 + 6
    assert engine.kv.pool.num_used_blocks == 0
