"""The offline API on the embedded default model: input validation, stopping, seeds, streaming."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=256)


def test_unknown_config_field_is_an_error():
    with pytest.raises(ValidationError, match="blok_size"):
        EngineConfig(model=str(DEFAULT_MODEL), blok_size=16)
    with pytest.raises(ValidationError, match="blok_size"):
        LLM(str(DEFAULT_MODEL), blok_size=16)


def test_bad_config_values_are_errors():
    with pytest.raises(ValidationError, match="block_size"):
        EngineConfig(model="m", block_size=0)
    with pytest.raises(ValidationError, match="device"):
        EngineConfig(model="m", device="tpu")


@pytest.mark.parametrize(
    "prompt, match",
    [("", "empty"), ([], "empty"), ([1, 2, 99999], "token ids"), ([1, -1], "token ids"), ([1, True], "token ids")],
)
def test_bad_prompts_are_rejected_and_nothing_is_queued(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 256], SamplingParams(max_tokens=1))
    out = llm.generate([[5] * 255], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_max_model_len_beyond_model_limit_is_an_error():
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=10**6)


def test_text_and_token_prompts_agree(llm):
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("def parse(text):")
    a, b = llm.generate(["def parse(text):", ids], p)
    assert a.token_ids == b.token_ids and a.text == b.text == llm.tokenizer.decode(list(a.token_ids))
    assert a.prompt_token_ids == tuple(ids)


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    first = llm.generate(["Return a list"], p)[0]
    # Same seed alone, and inside a different batch: the same tokens.
    again = llm.generate(["Other prompt", "Return a list", "x"], [SamplingParams(max_tokens=5), p, p])
    assert again[1].token_ids == first.token_ids
    other = llm.generate(["Return a list"], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert other[0].token_ids != first.token_ids


def test_stop_token_ids_and_eos_end_generation(llm):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = llm.generate(["The quick"], greedy)[0].token_ids
    stop_at = ref[3]
    cut = llm.generate(["The quick"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_at
    assert cut.token_ids == ref[: ref.index(stop_at) + 1]
    # Treat that same token as EOS: generation stops there unless ignore_eos.
    llm.engine.eos_token_ids = frozenset({stop_at})
    try:
        eos = llm.generate(["The quick"], SamplingParams(max_tokens=20, temperature=0))[0]
        assert eos.finish_reason == "stop" and eos.token_ids[-1] == stop_at
        ignored = llm.generate(["The quick"], greedy)[0]
        assert ignored.finish_reason == "length" and len(ignored.token_ids) == 20
    finally:
        llm.engine.eos_token_ids = llm.tokenizer.eos_token_ids


def test_stop_string_ends_generation_and_is_not_returned(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(["Parse the"], greedy)[0].text
    assert len(full) > 6
    stop = full[4:7]
    out = llm.generate(["Parse the"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_stream_yields_deltas_that_add_up(llm):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = ["Open the file", "Close it"]
    final = llm.generate(prompts, p)
    pieces: dict[str, list] = {}
    last = {}
    for out in llm.stream(prompts, p):
        pieces.setdefault(out.request_id, []).append(out)
        last[out.request_id] = out
    assert len(last) == 2 and all(o.finished for o in last.values())
    by_prompt = {o.prompt: o for o in last.values()}
    for f in final:
        streamed = pieces[by_prompt[f.prompt].request_id]
        assert "".join(o.delta_text for o in streamed) == f.text
        assert tuple(t for o in streamed for t in o.delta_token_ids) == f.token_ids
        assert len(streamed) == 10


def test_abandoned_stream_frees_its_blocks(llm):
    it = llm.stream(["Something long"], SamplingParams(max_tokens=50, ignore_eos=True))
    next(it)
    assert llm.engine.kv.pool.num_used_blocks > 0
    it.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_used_blocks == 0
