"""MLA models in the engine: greedy tokens equal HF transformers (fp32, CPU) over the latent store,
under paged decode, chunked prefill and prefix caching, with layer 0 a dense MLP and layer 1 routed
experts (DeepSeek-V2: greedy softmax; GLM-4.7-Flash: sigmoid over 2 groups with a selection bias,
shared experts); the pool holds one latent row per token."""

from __future__ import annotations

import random

import pytest
import torch
from summary_checks import assert_summarizes
from tiny_models import MLA_FAMILIES, hf_greedy, mla_config

from sparse_serve import LLM, SamplingParams

MAX_NEW = 10
REGIMES = {
    "block16": dict(block_size=16),
    "chunk7": dict(block_size=4, max_num_batched_tokens=7),
    "prefix_cache": dict(block_size=4, enable_prefix_caching=True),
}


@pytest.fixture(scope="module")
def mla_checkpoint(tmp_path_factory):
    """``mla_checkpoint(name, **overrides)`` -> (folder, HF model in eval mode, fp32)."""
    made = {}

    def make(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in made:
            config, model_cls = mla_config(name, **overrides)
            torch.manual_seed(1234)
            model = model_cls(config).eval()
            with torch.no_grad():  # HF starts the selection bias at zero
                for name, buf in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        buf.copy_(torch.rand_like(buf) * 0.2)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[key] = (path, model)
        return made[key]

    return make


def _prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 384) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 384) for _ in range(n)] for n in (5, 23, 1, 40)]


@pytest.mark.parametrize("name", MLA_FAMILIES)
@pytest.mark.parametrize("regime", REGIMES)
def test_mla_greedy_matches_hf(mla_checkpoint, name, regime):
    path, hf_model = mla_checkpoint(name)
    prompts = _prompts(seed=3, shared_prefix=20 if regime == "prefix_cache" else 0)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", **REGIMES[regime])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    if regime == "prefix_cache":
        assert list(llm.generate([prompts[0]], params)[0].token_ids) == expected[0]
        outs = llm.generate(prompts[1:], params)
        assert [list(o.token_ids) for o in outs] == expected[1:]
        assert all(o.num_cached_tokens >= 20 for o in outs)
    else:
        outs = llm.generate(prompts, params)
        assert [list(o.token_ids) for o in outs] == expected
    assert engine.kv.pool.num_used_blocks == 0


def test_latent_pool_holds_one_row_per_token(mla_checkpoint):
    path, _ = mla_checkpoint("glm4_moe_lite")
    runner = LLM(str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=10).engine.runner
    assert runner.store.latent and runner.store.describe() == "latent paged (32 latent + 16 rope)"
    assert [t.name for t in runner.store.block_tensors] == ["kv"]
    assert runner.kv.nbytes() == 2 * 10 * 8 * (32 + 16) * 4  # layers x blocks x tokens x row x fp32
    assert runner.kv_bytes_per_block == 2 * 8 * (32 + 16) * 4
    with pytest.raises(ValueError, match="latent store"):
        LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8")


LARGE_BUDGETS = {
    "snapkv": dict(sparse_method="snapkv", decode_keep_tokens=1000, decode_eviction_interval=4),
    "h2o": dict(sparse_method="h2o", h2o_prefill_budget=1000, h2o_decode_budget=1000, decode_eviction_interval=4),
    "streamingllm": dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=1000),
    "pyramidkv": dict(sparse_method="pyramidkv", decode_keep_tokens=1000),  # a table per layer
}


@pytest.mark.parametrize("case", LARGE_BUDGETS)
def test_mla_budget_above_context_is_dense(mla_checkpoint, case):
    """An eviction method scoring through the absorbed queries keeps everything at large budgets."""
    path, _ = mla_checkpoint("glm4_moe_lite")
    prompts = _prompts(seed=5)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16)
    dense = [o.token_ids for o in LLM(str(path), **base).generate(prompts, params)]
    assert [o.token_ids for o in LLM(str(path), **base, **LARGE_BUDGETS[case]).generate(prompts, params)] == dense


def test_mla_snapkv_evicts_latents_to_its_budget(mla_checkpoint):
    """A small SnapKV budget compacts each layer's latents: after prefill a long prompt holds the
    planned resident tokens, its freed blocks go back, and every request finishes."""
    path, _ = mla_checkpoint("deepseek_v2")
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=4,
        sparse_method="snapkv",
        decode_keep_tokens=12,
        recent_keep_tokens=4,
        sink_keep_tokens=2,
        observation_window_size=4,
        decode_eviction_interval=0,
    )
    engine = llm.engine
    engine.add_request(_prompts(seed=9)[3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "r")
    engine.step()  # the whole 40-token prompt, then compaction
    req = engine.scheduler.running[0]
    plan = engine.method.memory_plan(40, 3, engine.config.max_num_batched_tokens)
    assert list(req.kv_lens) == list(plan.resident_tokens) == [2 + 12 + 4] * 2  # sink + keep + recent
    assert len(engine.kv.table("r").block_ids) == -(-max(req.kv_lens) // 4)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_used_blocks == 0


def test_latent_compaction_moves_kept_rows_to_the_front():
    from sparse_cache import latent_paged
    from sparse_methods import Compaction
    from sparse_serve.kv_compaction import apply_compaction
    from sparse_serve.kv_pool import allocate_kv_pool

    pool = allocate_kv_pool(latent_paged(4, 6, 2), 1, 5, torch.float32, "cpu")
    pool.latent[0].copy_(torch.randn(5, 4, 1, 8))
    blocks, kept = [3, 0, 4], torch.tensor([[0, 2, 5, 6, 9]])
    slots = torch.tensor([b * 4 + i for b in blocks for i in range(4)])[:10]
    before = pool.latent[0].view(-1, 8)[slots].clone()
    assert apply_compaction(pool, blocks, [10], Compaction(keep=(kept,)), 4) == [5]
    torch.testing.assert_close(pool.latent[0].view(-1, 8)[slots[:5]], before[kept[0]])


def test_methods_without_mla_support_are_refused(mla_checkpoint):
    path, _ = mla_checkpoint("glm4_moe_lite")
    with pytest.raises(ValueError, match="tova does not support MLA models"):
        LLM(str(path), device="cpu", dtype="float32", sparse_method="tova")


def test_synthetic_latent_noise_keeps_block_summaries_true(mla_checkpoint):
    """Benchmarks' synthetic prefill over a latent store with block summaries (Quest on MLA): the
    summaries are the min / max of each block's noisy latent rows (Quest's int8 codes of them), not left
    at zero."""
    path, _ = mla_checkpoint("glm4_moe_lite")
    runner = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=12,
        sparse_method="quest",
        quest_chunk_size=4,
    ).engine.runner
    runner.randomize_kv(seed=3)
    for layer, rows in enumerate(runner.kv.latent):
        kmin, kmax, kscale = runner.kv.summary(layer)
        for block in range(rows.shape[0]):
            assert_summarizes(kmin[block], kmax[block], kscale[block], rows[block])
        assert not torch.equal(kmin, kmax)
