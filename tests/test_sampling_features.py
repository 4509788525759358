"""Engine-side sampling features the OpenAI surface needs: logprobs, prompt logprobs, penalties,
min_tokens, logit bias, stop strings kept in the output, and a request that fails alone."""

from __future__ import annotations

import pytest
import torch
from tiny_models import DEFAULT_MODEL
from transformers import AutoModelForCausalLM

from sparse_serve import LLM, SamplingParams

PROMPT = "def read_file(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def llm():
    # A small token budget: the prompt is prefilled in chunks, so prompt logprobs cross chunk edges.
    return LLM(str(DEFAULT_MODEL), device="cpu", max_model_len=256, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def hf_logprobs():
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return logprobs


def test_prompt_and_output_logprobs_equal_hf(llm, hf_logprobs):
    llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))  # its prefix is cached now
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=3)
    out = llm.generate(PROMPT, params)[0]
    ids = list(out.prompt_token_ids) + list(out.token_ids)
    ref = hf_logprobs(ids)
    assert out.num_cached_tokens == 0  # prompt logprobs need every prompt row computed
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for pos in range(1, len(ids)):
        entry = (
            out.prompt_logprobs[pos]
            if pos < len(out.prompt_token_ids)
            else out.logprobs[pos - len(out.prompt_token_ids)]
        )
        assert entry.token_id == ids[pos]
        assert entry.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == ref[pos - 1].topk(len(entry.top)).indices.tolist()
    assert len(out.logprobs[0].top) == 2 and len(out.prompt_logprobs[1].top) == 3
    # Greedy: each generated token is the most likely one.
    assert all(e.top[0][0] == e.token_id for e in out.logprobs)


def test_penalties_and_logit_bias_change_greedy_output(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    first = plain.token_ids[0]
    banned = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, logit_bias={first: -100}))[0]
    assert banned.token_ids[0] != first
    forced = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, logit_bias={7: 100}))[0]
    assert forced.token_ids == (7, 7, 7)
    # A strong frequency penalty makes a repeated token unlikely: no token repeats right after itself.
    forced_rep = llm.generate(
        PROMPT, SamplingParams(max_tokens=3, temperature=0, logit_bias={7: 5.0}, frequency_penalty=2.0)
    )[0]
    assert forced_rep.token_ids != forced.token_ids
    rep = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, repetition_penalty=5.0))[0]
    assert len(set(rep.token_ids)) == len(rep.token_ids)


def test_min_tokens_keeps_eos_away(llm):
    eos = min(llm.engine.eos_token_ids)
    # logit_bias makes EOS the greedy choice at once; min_tokens holds it off for 5 tokens.
    early = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100}))[0]
    assert early.token_ids == (eos,) and early.finish_reason == "stop"
    held = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100}, min_tokens=5))[0]
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5]


def test_include_stop_str_in_output(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    stop = plain.text[3:5]
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    kept = llm.generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=[stop], include_stop_str_in_output=True)
    )[0]
    assert kept.text == cut.text + stop and plain.text.startswith(kept.text)


def test_a_request_whose_postprocessing_fails_ends_alone(llm):
    engine = llm.engine
    bad = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0))
    good = engine.add_request(PROMPT + " x", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))

    def broken(token_id):
        raise UnicodeError("injected detokenizer fault")

    engine._detok[bad].add = broken
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[bad].finish_reason == "error" and "injected detokenizer fault" in finals[bad].error
    assert finals[good].finish_reason == "length" and len(finals[good].token_ids) == 8
    assert engine.kv.pool.num_used_blocks == 0 or not engine.has_unfinished_requests()
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].finish_reason == "length"
