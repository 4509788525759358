"""The parts of the OpenAI / vLLM server surface that real clients use, through the official ``openai``
client where it has the field: logprobs and echo, several prompts and n, the tokenizer routes,
API keys, CORS, several served names, chat templates and the sampling extensions."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, EngineConfig, SamplingParams
from sparse_serve.engine import LLMEngine
from sparse_serve.server import ServerConfig
from sparse_serve.server.background import BackgroundServer

MODEL = "tiny-retrieval"
ALIAS = "tiny-alias"
KEY = "sk-test-key"
ENGINE = dict(model=str(DEFAULT_MODEL), device="cpu", max_model_len=256, num_kv_blocks=256, block_size=16)
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
PROMPT = "def load(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(
        port=0,
        access_log=False,
        log_level="warning",
        served_model_name=(MODEL, ALIAS),
        api_key=KEY,
        allowed_origins=("https://ui.example",),
        chat_template=TEMPLATE,
    )
    with BackgroundServer(LLMEngine(EngineConfig(**ENGINE)), config) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


AUTH = {"authorization": f"Bearer {KEY}"}


def test_api_key_is_required_in_openai_shape(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    # Probes stay open, as in vLLM.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_cors_preflight_and_origin(server):
    pre = httpx.options(
        server.url + "/v1/completions",
        headers={"origin": "https://ui.example", "access-control-request-method": "POST"},
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ui.example"
    other = httpx.get(server.url + "/health", headers={"origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_several_served_names(client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    out = client.completions.create(model=ALIAS, prompt="x", max_tokens=2)
    assert out.model == ALIAS
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)


def test_chat_template_flag_is_used(server, offline):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    out = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH).json()
    ref = offline.generate("[user] hi\n[assistant]", SamplingParams(max_tokens=3, temperature=0))[0]
    assert out["choices"][0]["message"]["content"] == ref.text
    assert out["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_tokenize_and_detokenize(server, offline):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, headers=AUTH).json()
    assert r["tokens"] == offline.tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=AUTH).json()
    assert back["prompt"] == PROMPT
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/tokenize", json=chat, headers=AUTH).json()
    assert r["tokens"] == offline.tokenizer.encode("[user] hi\n[assistant]", add_special_tokens=False)
    info = httpx.get(server.url + "/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] and info["chat_template"] == TEMPLATE and info["model_max_length"] == 256
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**7]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_completion_logprobs_and_echo(client, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))[0]
    choice = out.choices[0]
    assert choice.text == PROMPT + ref.text
    lp = choice.logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert "".join(lp.tokens) == choice.text and lp.text_offset[1] == len(lp.tokens[0])
    # Greedy: the sampled token is the best of its top alternatives (what lm-eval's is_greedy reads).
    for tok_lp, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:], strict=True):
        assert len(top) >= 2 and math.isclose(tok_lp, max(top.values()), abs_tol=1e-6)
    zero = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs[0] and len(zero.choices[0].logprobs.tokens) == 2


def test_chat_top_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert "".join(c.token for c in content) == out.choices[0].message.content


def test_several_prompts_and_n(client, offline):
    prompts = ["import os", "class A:"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    refs = offline.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    sampled = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=6, seed=7, temperature=1.0)
    assert [c.index for c in sampled.choices] == list(range(6))
    again = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=6, seed=7, temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # reproducible per seed
    assert len({c.text for c in sampled.choices[:3]}) > 1  # the n samples differ
    assert 6 <= sampled.usage.completion_tokens <= 36
    # Sample 0 of each prompt equals a lone request with the seed; sample i uses seed + i.
    lone = client.completions.create(model=MODEL, prompt="class A:", max_tokens=6, seed=8, temperature=1.0)
    assert sampled.choices[4].text == lone.choices[0].text


def _hit_tokens(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("sparse_prefix_cache_hit"))
    return float(line.split()[-1])


def test_n_shares_the_prompt_through_the_prefix_cache(server, client):
    prompt = "".join(f"v{i} = {i * i}\n" for i in range(12))  # several blocks, not cached before
    before = _hit_tokens(server.url)
    out = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=2, temperature=1.0, seed=1)
    num_prompt = len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=AUTH).json()["tokens"])
    assert len(out.choices) == 4 and out.usage.prompt_tokens == num_prompt  # the prompt counted once
    # Samples 1-3 went in after sample 0's prompt was computed: each found its full blocks cached.
    full_blocks = (num_prompt - 1) // 16 * 16
    assert full_blocks >= 32 and _hit_tokens(server.url) - before >= 3 * full_blocks


def test_streaming_n_and_continuous_usage(server):
    body = {
        "model": MODEL,
        "prompt": "import os",
        "n": 2,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = [c for c in chunks if c["choices"]]
    assert sorted(c["choices"][0]["index"] for c in content) == [0] * 4 + [1] * 4
    # continuous_usage_stats (guidellm's streaming mode sends it): every chunk carries its choice's usage.
    assert all(c["usage"]["completion_tokens"] >= 1 for c in content)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_sampling_extensions_over_http(client, offline):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    first = offline.tokenizer.encode(PROMPT + plain.choices[0].text)[len(offline.tokenizer.encode(PROMPT))]
    biased = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(first): -100}
    )
    assert biased.choices[0].text != plain.choices[0].text
    penalized = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, frequency_penalty=2.0, presence_penalty=1.0
    )
    ref = offline.generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0, frequency_penalty=2.0, presence_penalty=1.0)
    )[0]
    assert penalized.choices[0].text == ref.text
    stop = plain.choices[0].text[2:4]
    kept = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True, "min_tokens": 1, "repetition_penalty": 1.0},
    )
    assert kept.choices[0].text.endswith(stop) and plain.choices[0].text.startswith(kept.choices[0].text)


def test_skip_special_tokens_false_shows_eos(server, offline):
    eos = min(offline.engine.eos_token_ids)
    eos_text = offline.tokenizer.decode([eos], skip_special_tokens=False)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "logit_bias": {str(eos): 100}, "temperature": 0}
    hidden = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH).json()
    shown = httpx.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": False}, headers=AUTH).json()
    assert hidden["choices"][0]["text"] == "" and shown["choices"][0]["text"] == eos_text


def test_json_mode_is_an_honest_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}
        )
    assert e.value.body["param"] == "response_format"
