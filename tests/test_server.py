"""The OpenAI-compatible server, through the official ``openai`` client, against offline generation."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, EngineConfig, SamplingParams
from sparse_serve.engine import LLMEngine
from sparse_serve.server.background import BackgroundServer
from sparse_serve.server.chat import FALLBACK_CHAT_TEMPLATE, ChatTemplate

MODEL = "tiny-retrieval"
# Small context and pool keep the CPU cost low; 256 blocks hold 64 requests of up to 64 tokens.
ENGINE = dict(model=str(DEFAULT_MODEL), device="cpu", max_model_len=256, num_kv_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(LLMEngine(EngineConfig(**ENGINE))) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_list_and_retrieve(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_completion_equals_offline(client, offline):
    out = client.completions.create(model=MODEL, prompt="def parse(text):", max_tokens=12, temperature=0)
    ref = offline.generate(["def parse(text):"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.model == MODEL and out.object == "text_completion"


def test_token_id_prompt_and_engine_extensions(client, offline):
    ids = offline.tokenizer.encode("import os")
    extra = {"ignore_eos": True, "top_k": 0}
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=9, temperature=0, extra_body=extra)
    ref = offline.generate([ids], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))[0]
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == 9


def test_chain_turns_over_http_equal_offline_chains(client, offline):
    """``chain_id`` / ``chain_append_start`` as extra body fields reach the engine's chain cache: two
    turns over HTTP give what the same two turns give offline."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, follow = offline.tokenizer.encode("def parse(text):"), offline.tokenizer.encode("\n    return")
    ref1 = offline.generate([first], params, chain_id="ref")[0]
    ref2 = offline.generate([follow], params, chain_id="ref", chain_append_start=len(first) + 6)[0]
    body = {"ignore_eos": True, "chain_id": "http-1"}
    out1 = client.completions.create(model=MODEL, prompt=first, max_tokens=6, temperature=0, extra_body=body)
    body["chain_append_start"] = len(first) + 6
    out2 = client.completions.create(model=MODEL, prompt=follow, max_tokens=6, temperature=0, extra_body=body)
    assert [out1.choices[0].text, out2.choices[0].text] == [ref1.text, ref2.text]
    assert ref2.chain_status == "resumed"


def test_cached_tokens_reported(client):
    prompt = "class Parser:\n    def __init__(self, text):\n        self.text = text\n" * 2  # > 1 block
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_stop_string_and_seed(client, offline):
    full = offline.generate(["Parse the"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    stop = full[4:7]
    out = client.completions.create(
        model=MODEL, prompt="Parse the", max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    a, b = (
        client.completions.create(model=MODEL, prompt="Open", max_tokens=10, temperature=1.0, seed=3) for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text


def test_chat_uses_the_tokenizers_template(client, offline):
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "What is os.path?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    template = ChatTemplate.from_pretrained(DEFAULT_MODEL)
    assert not template.is_fallback  # the tiny model ships a ChatML template in tokenizer_config.json
    prompt = template.render(messages)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = offline.tokenizer.encode(prompt, add_special_tokens=False)
    ref = offline.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    # A message echoed back from a response (None-valued fields included) is accepted.
    again = messages + [out.choices[0].message.model_dump(), {"role": "user", "content": "More?"}]
    assert client.chat.completions.create(model=MODEL, messages=again, max_tokens=2).choices[0].message.content


def test_fallback_template_is_chatml(tmp_path):
    template = ChatTemplate.from_pretrained(tmp_path)  # no tokenizer_config.json
    assert template.is_fallback and template.source == FALLBACK_CHAT_TEMPLATE
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_streaming_chat_and_completion(client, offline):
    ref = offline.generate(["The quick"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True
    )
    chat = list(stream)
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chat)  # usage only when asked for with include_usage


def test_raw_stream_ends_with_done(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_64_concurrent_streams_equal_offline(server, offline):
    prompts = [f"def function_{i}(" + "x, " * (i % 7) for i in range(64)]
    max_tokens = [6 + i % 11 for i in range(64)]
    refs = offline.generate(prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens])

    async def one(client, prompt, n):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return "".join(text), finish, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, max_tokens, strict=True)))

    results = asyncio.run(main())
    for (text, finish, n_tokens), ref in zip(results, refs, strict=True):
        assert (text, finish, n_tokens) == (ref.text, ref.finish_reason, len(ref.token_ids))


_SAMPLE = re.compile(r'^([a-z_:][a-z0-9_:]*)(\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})? (\S+)$')


def _parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a text exposition, checked against its # TYPE, keyed by name plus labels."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"bad sample line: {line!r}"
            family = re.sub(r"_(bucket|sum|count)$", "", m[1]) if m[1] not in types else m[1]
            assert family in types, f"{m[1]} has no # TYPE"
            samples[m[1] + (m[2] or "")] = float(m[3])
    for name, kind in types.items():
        if kind == "histogram":
            buckets = [v for k, v in samples.items() if k.startswith(name + "_bucket")]
            count = next(v for k, v in samples.items() if k.startswith(name + "_count"))
            assert buckets == sorted(buckets) and buckets[-1] == count
    return samples


def test_metrics_parse_and_count(server, client):
    before = _parse_metrics(httpx.get(server.url + "/metrics").text)
    out = client.completions.create(model=MODEL, prompt="a b c", max_tokens=7, temperature=0)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = _parse_metrics(r.text)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["sparse_generation_tokens_total"] == out.usage.completion_tokens
    assert delta["sparse_prompt_tokens_total"] == out.usage.prompt_tokens
    assert delta["sparse_time_to_first_token_seconds_count"] == 1
    assert delta["sparse_inter_token_latency_seconds_count"] == out.usage.completion_tokens - 1
    assert delta['sparse_requests_finished_total{finish_reason="' + out.choices[0].finish_reason + '"}'] == 1
    assert after["sparse_kv_blocks_total"] == 256
    assert after["sparse_kv_blocks_used"] + after["sparse_kv_blocks_free"] == 256
    assert after["sparse_requests_running"] == 0 and after["sparse_requests_waiting"] == 0
    # The same series under vLLM's names, for dashboards built for vLLM.
    label = '{model_name="tiny-retrieval"}'
    assert delta["vllm:generation_tokens_total" + label] == out.usage.completion_tokens
    assert delta["vllm:prompt_tokens_total" + label] == out.usage.prompt_tokens
    assert delta["vllm:time_to_first_token_seconds_count" + label] == 1
    assert delta["vllm:e2e_request_latency_seconds_count" + label] == 1
    reason = out.choices[0].finish_reason
    assert delta['vllm:request_success_total{model_name="tiny-retrieval",finished_reason="' + reason + '"}'] == 1
    assert after["vllm:num_requests_running" + label] == 0 and after["vllm:num_requests_waiting" + label] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc" + label] <= 1


def test_health(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
