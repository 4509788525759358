"""KVzip (context-reconstruction scores from engine-run replay passes) on CPU, fp32: kept sets equal
kvpress's KVzipPress on the embedded model (its tokenizer, without a chat template), pair-level and
layerwise; the replays leave the request's tokens and KV length as they were; each head decodes over
its own tokens only; a budget above the context runs no replay and equals dense."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_adakv import _masked_decode_reference, head_kept, masked_kept
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, SamplingParams

PROMPT_LEN = 200
CHUNK = 64


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """The embedded checkpoint without its chat template (kvpress then ends its instruction with a newline)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("kvzip") / "model"
    shutil.copytree(DEFAULT_MODEL, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=g).tolist()


def _kvpress_kept(model, prompt, ratio, layerwise) -> list[list[set[int]]]:
    from kvpress import KVzipPress
    from transformers import DynamicCache

    press = KVzipPress(compression_ratio=ratio, layerwise=layerwise, n_sink=4, chunk_size=CHUNK)
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([prompt]), past_key_values=DynamicCache())
    return masked_kept(model, len(prompt))


def _llm(path, **params) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=4096,
        sparse_method="kvzip",
        **params,
    )


def _params(budget: int, layerwise: bool = False) -> dict:
    return dict(
        kvzip_token_budget=budget, kvzip_score_chunk_size=CHUNK, kvzip_prev_postfix_size=8, kvzip_layerwise=layerwise
    )


def _engine_kept(llm, model, prompt) -> list[list[set[int]]]:
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt (and the first token)
    req = engine.scheduler.running[0]
    assert req.num_replays_done == 0 and len(req.replay_passes) == -(-len(prompt) // CHUNK)
    for _ in req.replay_passes:
        engine.step()
        assert req.num_computed_tokens == len(prompt) and req.num_output_tokens == 1  # replays add nothing
    kept = head_kept(engine, rid, model, prompt)
    engine.abort_request(rid)
    return kept


@pytest.mark.parametrize(("ratio", "layerwise"), [(0.5, False), (0.75, False), (0.5, True)])
def test_kvzip_matches_kvpress(plain_model, ratio, layerwise):
    path, model = plain_model
    prompt = _prompt(1)
    budget = int(PROMPT_LEN * (1 - ratio))
    ours = _engine_kept(_llm(path, **_params(budget, layerwise)), model, prompt)
    assert ours == _kvpress_kept(model, prompt, ratio, layerwise)
    sizes = [[len(s) for s in layer] for layer in ours]
    if layerwise:
        assert all(sum(layer) == len(layer) * budget for layer in sizes)
    else:
        assert sum(map(sum, sizes)) == len(sizes) * len(sizes[0]) * budget
        assert len({sum(layer) for layer in sizes}) > 1  # layers keep different amounts
    assert all(set(range(4)) <= s for layer in ours for s in layer)  # sinks


def test_kvzip_decode_reads_each_heads_own_tokens(plain_model):
    path, model = plain_model
    prompt = _prompt(2)
    params = _params(60)
    kept = _engine_kept(_llm(path, **params), model, prompt)
    out = _llm(path, **params).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert list(out.token_ids) == _masked_decode_reference(model, prompt, kept, 6)


def test_kvzip_budget_above_context_is_dense(plain_model):
    path, _ = plain_model
    prompt = _prompt(3, 120)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    dense = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=4096).generate([prompt], greedy)[0]
    llm = _llm(path, kvzip_token_budget=120)
    assert llm.generate([prompt], greedy)[0].token_ids == dense.token_ids
    assert llm.engine.num_steps == 8  # no replay pass ran


def test_kvzip_chain_resumes_its_ragged_heads(plain_model):
    """A chain keeps a table per (layer, KV head) with ragged counts; the next turns prefill over each
    head's own slots (no replay: the KV is compacted already) and equal one uninterrupted session."""
    from test_chain_cache_engine import _check_blocks, _uninterrupted

    path, _ = plain_model
    llm = _llm(path, **_params(60))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    turns = [_prompt(7, 150), _prompt(8, 40), _prompt(9, 5)]
    expected = _uninterrupted(llm, turns, greedy.max_tokens)
    prompt, outs = turns[0], []
    for suffix in [None, *turns[1:]]:
        if suffix is not None:
            prompt = prompt + list(outs[-1]) + suffix
        outs.append(llm.generate(prompt, greedy, chain_id="c")[0].token_ids)
        _check_blocks(llm)
        lens = llm.engine.chain_info("c").kv_lens
        assert len(lens) == llm.engine.kv.layout.num_tables and len(set(lens)) > 1  # per lane, ragged
    assert outs == expected
    llm.drop_chain("c")
    assert llm.engine.kv.pool.num_used_blocks == 0
