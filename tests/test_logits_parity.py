"""Full-forward logits through the engine's paged path equal HF transformers within 1e-4 (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES

from sparse_serve import LLM, SamplingParams
from sparse_serve.step_metadata import build_step_metadata


def _engine_logits(llm: LLM) -> list[torch.Tensor]:
    """Run one scheduled step and return every token's logits, per scheduled request."""
    engine, runner = llm.engine, llm.engine.runner
    batch = engine.scheduler.schedule()
    meta = build_step_metadata(batch, engine.kv.table, engine.config.block_size)
    with torch.inference_mode():
        runner.attention.plan(meta)
        hidden = runner.model(meta.input_ids, meta.positions, runner.attention)
        logits = runner.model.compute_logits(hidden)
    for req, n in batch.items:
        req.num_computed_tokens += n
        req.kv_lens = [kv_len + n for kv_len in req.kv_lens]
    sizes = [n for _, n in batch.items]
    return list(torch.split(logits, sizes))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_prefill_logits_match_hf(tiny_checkpoint, family, block_size):
    path, hf_model = tiny_checkpoint(family)
    prompts = [list(range(3, 40)), list(range(100, 109)), [7]]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=block_size, enable_prefix_caching=False)
    for p in prompts:
        llm.engine.add_request(p, SamplingParams(max_tokens=1))
    got = _engine_logits(llm)
    by_len = {len(p): p for p in prompts}
    for logits in got:
        with torch.no_grad():
            ref = hf_model(torch.tensor([by_len[logits.shape[0]]])).logits[0]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_chunked_prefill_over_cached_prefix_matches_hf(tiny_checkpoint, family):
    path, hf_model = tiny_checkpoint(family)
    prompt = list(range(3, 53))
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=19)
    llm.engine.add_request(prompt, SamplingParams(max_tokens=1))
    chunks = [_engine_logits(llm)[0] for _ in range(3)]  # 19 + 19 + 12 tokens
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(torch.cat(chunks), ref, atol=1e-4, rtol=0)
