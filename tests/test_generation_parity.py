"""Greedy generation equals HF transformers token for token (fp32, CPU), under each engine regime."""

from __future__ import annotations

import random

import pytest
from tiny_models import FAMILIES, hf_greedy

from sparse_serve import LLM, SamplingParams

MAX_NEW = 12


def _prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 384) for _ in range(shared_prefix)]
    lengths = [5, 23, 1, 40, 17]
    return [prefix + [rng.randrange(3, 384) for _ in range(n)] for n in lengths]


REGIMES = {
    "block1": dict(block_size=1),
    "block16": dict(block_size=16),
    "chunk7": dict(block_size=4, max_num_batched_tokens=7),
    "prefix_cache": dict(block_size=4, enable_prefix_caching=True),
    "preempt": dict(block_size=4, num_kv_blocks=24, max_num_seqs=8),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_hf(tiny_checkpoint, family, regime):
    path, hf_model = tiny_checkpoint(family)
    prompts = _prompts(seed=7, shared_prefix=20 if regime == "prefix_cache" else 0)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", **REGIMES[regime])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    if regime == "prefix_cache":
        # First one prompt alone, so its blocks are cached before the others arrive.
        first = llm.generate([prompts[0]], params)[0]
        assert list(first.token_ids) == expected[0]
        outs = llm.generate(prompts[1:], params)
        assert [list(o.token_ids) for o in outs] == expected[1:]
        assert engine.prefix_hit_tokens >= 20 // 4 * 4 * (len(prompts) - 1)
        assert all(o.num_cached_tokens >= 20 for o in outs)
    else:
        outs = llm.generate(prompts, params)
        assert [list(o.token_ids) for o in outs] == expected
    if regime == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.num_free_blocks == engine.kv.num_blocks - engine.kv.pool.num_used_blocks
    assert engine.kv.pool.num_used_blocks == 0


def test_requests_joining_mid_generation_match_hf(tiny_checkpoint):
    """Continuous batching: requests arrive while others decode, and still equal HF."""
    path, hf_model = tiny_checkpoint("qwen3")
    prompts = _prompts(seed=11)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    engine = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16).engine
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    done: dict[str, list[int]] = {}
    ids = []
    for step in range(200):
        if step % 3 == 0 and len(ids) < len(prompts):
            ids.append(engine.add_request(prompts[len(ids)], params))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        if len(done) == len(prompts):
            break
    assert [done[i] for i in ids] == expected
    assert engine.num_steps < 200 and engine.kv.pool.num_used_blocks == 0
