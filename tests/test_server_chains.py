"""The chain cache over HTTP (``/v1/chains/...`` and the chain fields of completions) against the
same operations offline: forks, drops, info, pruning and ``usage.reused_tokens``; bad input gets a
clear error and the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from test_server import ENGINE, MODEL
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, EngineConfig, SamplingParams
from sparse_serve.engine import LLMEngine
from sparse_serve.server.background import BackgroundServer
from sparse_serve.server.chains import chain_json
from sparse_serve.server.chat import ChatTemplate

SNAPKV = dict(
    sparse_method="snapkv",
    sink_keep_tokens=4,
    decode_keep_tokens=20,
    recent_keep_tokens=16,
    observation_window_size=8,
    decode_eviction_interval=3,
)
CONFIGS = {"dense": ENGINE, "snapkv": {**ENGINE, **SNAPKV}}
N = 6  # tokens generated per turn
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


HISTORY = _tokens(70, 1)  # cached on the dense server: 4 full blocks of 16, then 6 tokens to score with


class _Setup:
    """A server, its engine, and an offline LLM of the same configuration."""

    def __init__(self, config: dict):
        self.engine = LLMEngine(EngineConfig(**config))
        self.offline = LLM(**config)
        self._server = BackgroundServer(self.engine)

    def __enter__(self) -> _Setup:
        self.url = self._server.__enter__().url
        return self

    def __exit__(self, *exc) -> None:
        self._server.__exit__(*exc)

    def complete(self, prompt, **extra) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True, **extra}
        r = httpx.post(self.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is faster than contending for a loaded box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dense():
    with _Setup(CONFIGS["dense"]) as setup:
        setup.complete(HISTORY, max_tokens=1)  # the radix cache holds HISTORY's full blocks
        setup.complete(_tokens(20, 2), chain_id="known")
        yield setup


@pytest.fixture(scope="module")
def snapkv():
    with _Setup(CONFIGS["snapkv"]) as setup:
        yield setup


@contextlib.contextmanager
def _paused(engine: LLMEngine):
    """Steps produce nothing until the block ends (the engine thread still takes commands), so a request
    stays queued and its chain checked out for as long as a test needs."""
    step, go = engine.step, threading.Event()

    def gated():
        if go.is_set():
            return step()
        time.sleep(0.002)
        return []

    engine.step = gated
    try:
        yield
    finally:
        go.set()
        del engine.step


def _error(r: httpx.Response, status: int, code: str | None, param: str | None = None, case: str = "") -> None:
    """An error in OpenAI's shape with this status and code (and ``param``, when given)."""
    assert r.status_code == status, (case, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], case
    assert (error["type"], error["code"]) == ("invalid_request_error", code), (case, error)
    if param is not None:
        assert error["param"] == param, (case, error)


@pytest.mark.parametrize("case", ["dense", "snapkv"])
def test_forks_continue_independently_and_equal_offline_forks(request, case):
    """Turn one, two forks (one named, one generated), both branches at once: each equals the same
    fork offline (text, reused_tokens, chain info), and the source chain is untouched."""
    setup = request.getfixturevalue(case)
    llm, url = setup.offline, setup.url
    prompt = _tokens(45, 3)
    ref = llm.generate(prompt, GREEDY, chain_id="src")[0]
    out = setup.complete(prompt, chain_id="src")
    assert out["choices"][0]["text"] == ref.text and (out["chain_id"], out["chain_status"]) == ("src", "created")
    source = httpx.get(url + "/v1/chains/src").json()
    assert source == chain_json(llm.chain_info("src"))

    named = httpx.post(url + "/v1/chains/fork", json={"chain_id": "src", "new_chain_id": "left"}).json()
    generated = httpx.post(url + "/v1/chains/fork", json={"chain_id": "src"}).json()
    right = generated["chain_id"]
    assert named == {**source, "chain_id": "left"} and generated == {**source, "chain_id": right}
    llm.fork_chain("src", "left")
    llm.fork_chain("src", "right")

    history = prompt + list(ref.token_ids)
    branches = [history + _tokens(9, 4), history + _tokens(14, 5)]
    refs = llm.generate(branches, GREEDY, chain_id=["left", "right"])

    async def both():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL,
                        prompt=p,
                        max_tokens=N,
                        temperature=0,
                        extra_body={"ignore_eos": True, "chain_id": c},
                    )
                    for p, c in zip(branches, ["left", right], strict=True)
                )
            )

    for got, want, cid in zip(asyncio.run(both()), refs, ["left", "right"], strict=True):
        assert got.choices[0].text == want.text
        assert got.usage.reused_tokens == want.reused_tokens == len(history) - 1
        assert (got.chain_status, want.chain_status) == ("resumed", "resumed")
        assert httpx.get(url + "/v1/chains/" + got.chain_id).json() == {
            **chain_json(llm.chain_info(cid)),
            "chain_id": got.chain_id,
        }
    assert refs[0].token_ids != refs[1].token_ids
    assert httpx.get(url + "/v1/chains/src").json() == source  # the branches wrote copies


def test_drop_then_naming_the_chain_is_404(dense):
    url = dense.url
    dense.complete(_tokens(20, 6), chain_id="gone")
    assert httpx.delete(url + "/v1/chains/gone").json() == {"object": "chain", "chain_id": "gone", "deleted": True}
    _error(httpx.get(url + "/v1/chains/gone"), 404, "chain_not_found", "chain_id")
    _error(httpx.delete(url + "/v1/chains/gone"), 404, "chain_not_found", "chain_id")
    _error(httpx.post(url + "/v1/chains/fork", json={"chain_id": "gone"}), 404, "chain_not_found", "chain_id")
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "chain_id": "gone", "chain_append_start": 3}
    _error(httpx.post(url + "/v1/completions", json=body), 404, "chain_not_found", "chain_id")
    # Naming a dropped chain without an append start starts it afresh, as offline.
    assert dense.complete(_tokens(20, 6), chain_id="gone")["chain_status"] == "created"


def test_busy_chain_is_409_and_the_server_recovers(dense):
    url, engine = dense.url, dense.engine
    body = {"model": MODEL, "prompt": _tokens(20, 7), "max_tokens": N, "chain_id": "busy", "stream": True}
    with _paused(engine):
        with httpx.stream("POST", url + "/v1/completions", json=body) as stream:
            assert stream.status_code == 200  # accepted: the request holds the chain until it ends
            info = httpx.get(url + "/v1/chains/busy").json()
            assert info["busy"] and info["num_tokens"] == 0 and info["kv_lens"] == []
            _error(httpx.post(url + "/v1/chains/fork", json={"chain_id": "busy"}), 409, "chain_busy", "chain_id")
            _error(httpx.delete(url + "/v1/chains/busy"), 409, "chain_busy", "chain_id")
            second = {**body, "stream": False}
            _error(httpx.post(url + "/v1/completions", json=second), 409, "chain_busy", "chain_id")
        deadline = time.monotonic() + 10
        while httpx.get(url + "/v1/chains/busy").json()["busy"]:  # the closed stream aborts its request
            assert time.monotonic() < deadline, "the aborted request kept its chain"
            time.sleep(0.02)
    assert httpx.get(url + "/v1/chains/busy").json()["num_tokens"] == 0  # handed back as it was
    assert dense.complete(_tokens(20, 7), chain_id="busy")["chain_status"] == "recreated"
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_chain_calls_run_on_the_engine_thread(dense, monkeypatch):
    """Fork, info, drop and prune reach the engine only from its own thread; an unexpected error in one
    is a 500 and the engine keeps serving."""
    engine, url, threads = dense.engine, dense.url, []

    def recording(real):
        def call(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return real(*args, **kwargs)

        return call

    for name in ("fork_chain", "chain_info", "drop_chain", "prune"):
        monkeypatch.setattr(engine, name, recording(getattr(engine, name)))
    fork = httpx.post(url + "/v1/chains/fork", json={"chain_id": "known"}).json()["chain_id"]
    assert httpx.get(url + "/v1/chains/" + fork).json()["num_tokens"] > 0
    assert httpx.delete(url + "/v1/chains/" + fork).json()["deleted"]
    pruned = httpx.post(url + "/v1/chains/prune", json={"prompt": HISTORY, "ranges": [[5, 20]], "keep_tokens": 2})
    assert httpx.delete(url + "/v1/chains/" + pruned.json()["chain_id"]).json()["deleted"]
    assert len(threads) == 7 and set(threads) == {"sparse-engine"}

    def broken(chain_id):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine, "chain_info", broken)
    r = httpx.get(url + "/v1/chains/known")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert httpx.get(url + "/v1/chains/known").json()["chain_id"] == "known"
    assert dense.complete([5, 6, 7], max_tokens=1)["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("keep", [3, 0])
def test_prune_over_http_equals_offline(dense, keep):
    """Same kept positions and retained count, a degraded chain, and a resumed turn with the same tokens."""
    llm, url = dense.offline, dense.url
    llm.generate(HISTORY, SamplingParams(max_tokens=1))
    ranges = [[5, 20], [30, 45]]
    ref = llm.prune(HISTORY, ranges, keep_tokens=keep, observation_window_size=6, chain_id=f"pruned-{keep}")
    body = {"prompt": HISTORY, "ranges": ranges, "keep_tokens": keep, "observation_window_size": 6}
    r = httpx.post(url + "/v1/chains/prune", json={**body, "policy": "snapkv_global", "chain_id": f"pruned-{keep}"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["kept"] == [list(k) for k in ref.kept] and all(len(k) == keep for k in got["kept"])
    assert (
        (got["num_tokens"], got["num_retained_tokens"])
        == (ref.num_tokens, ref.num_retained_tokens)
        == (64, 34 + 2 * keep)
    )
    assert {k: v for k, v in got.items() if k != "kept"} == chain_json(llm.chain_info(ref.chain_id))
    assert got["degraded"] and not got["busy"]

    suffix = HISTORY + _tokens(8, 8)
    want = llm.generate(suffix, GREEDY, chain_id=ref.chain_id)[0]
    out = dense.complete(suffix, chain_id=got["chain_id"])
    assert out["choices"][0]["text"] == want.text
    assert out["usage"]["reused_tokens"] == want.reused_tokens == 64 and out["chain_status"] == "resumed"
    # A generated id, and a text prompt encoded as /v1/completions encodes it.
    again = httpx.post(url + "/v1/chains/prune", json={**body, "model": MODEL})
    assert (
        again.status_code == 200 and again.json()["kept"] == got["kept"] and again.json()["chain_id"] != got["chain_id"]
    )


def test_prune_kvzip_global_over_http_equals_offline(dense):
    """kvzip_global with its fields: the offline kept positions (one budget over both ranges); the last
    range may end the prompt (replays score it, not queries after it)."""
    llm = dense.offline
    llm.generate(HISTORY, SamplingParams(max_tokens=1))
    args = dict(keep_tokens=6, policy="kvzip_global", kvzip_score_chunk_size=16, kvzip_prev_postfix_size=4)
    ref = llm.prune(HISTORY[:64], [(5, 20), (30, 64)], **args)
    body = {"prompt": HISTORY[:64], "ranges": [[5, 20], [30, 64]], **args}
    r = httpx.post(dense.url + "/v1/chains/prune", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["kept"] == [list(k) for k in ref.kept] and sum(map(len, ref.kept)) == 6
    assert r.json()["num_retained_tokens"] == ref.num_retained_tokens == 64 - 49 + 6


def test_prune_a_text_prompt(dense):
    text = "def parse(text):\n    tokens = text.split()\n    return [t.strip() for t in tokens if t]\n" * 3
    llm = dense.offline
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 40
    llm.generate(text, SamplingParams(max_tokens=1))
    dense.complete(text, max_tokens=1)
    ref = llm.prune(text, [(2, 30)], keep_tokens=4)
    r = httpx.post(dense.url + "/v1/chains/prune", json={"prompt": text, "ranges": [[2, 30]], "keep_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["kept"] == [list(k) for k in ref.kept] and r.json()["num_tokens"] == ref.num_tokens


def test_reused_tokens_in_chat_usage_streamed_and_not(dense):
    llm, url = dense.offline, dense.url
    template = ChatTemplate.from_pretrained(DEFAULT_MODEL)
    first = [{"role": "user", "content": "What does os.path.join do?"}]
    follow = [{"role": "user", "content": "And os.path.split?"}]
    ids1 = llm.tokenizer.encode(template.render(first), add_special_tokens=False)
    ids2 = llm.tokenizer.encode(template.render(follow), add_special_tokens=False)
    ref1 = llm.generate(ids1, GREEDY, chain_id="chat-ref")[0]
    start = len(ids1) + N
    ref2 = llm.generate(ids2, GREEDY, chain_id="chat-ref", chain_append_start=start)[0]

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    common = dict(model=MODEL, max_tokens=N, temperature=0)
    out1 = client.chat.completions.create(messages=first, extra_body={"ignore_eos": True, "chain_id": "chat"}, **common)
    assert out1.choices[0].message.content == ref1.text
    assert (out1.usage.reused_tokens, out1.chain_id, out1.chain_status) == (0, "chat", "created")
    chunks = list(
        client.chat.completions.create(
            messages=follow,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "chain_id": "chat", "chain_append_start": start},
            **common,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref2.text
    last, usage = chunks[-2], chunks[-1]
    assert last.choices[0].finish_reason == "length" and (last.chain_id, last.chain_status) == ("chat", "resumed")
    assert usage.usage.reused_tokens == ref2.reused_tokens == start - 1 and usage.chain_status == "resumed"
    plain = client.completions.create(prompt="Open the", max_tokens=2, model=MODEL)
    assert plain.usage.reused_tokens == 0 and "chain_id" not in plain.model_extra


FORK, PRUNE = "/v1/chains/fork", "/v1/chains/prune"
P = {"prompt": HISTORY, "ranges": [[5, 20]], "keep_tokens": 2}  # a good prune body
BAD = [
    # (case, method, path, body (dict, or raw text), status, error code, param)
    ("fork unknown chain", "POST", FORK, {"chain_id": "nope"}, 404, "chain_not_found", "chain_id"),
    (
        "fork onto a taken id",
        "POST",
        FORK,
        {"chain_id": "known", "new_chain_id": "known"},
        400,
        "chain_exists",
        "new_chain_id",
    ),
    ("fork chain_id number", "POST", FORK, {"chain_id": 5}, 400, "invalid_value", "chain_id"),
    ("fork empty chain_id", "POST", FORK, {"chain_id": ""}, 400, "invalid_value", "chain_id"),
    ("fork without chain_id", "POST", FORK, {}, 400, "missing_required_parameter", "chain_id"),
    ("fork unknown field", "POST", FORK, {"chain_id": "known", "deep": True}, 400, "unknown_parameter", "deep"),
    ("fork other model", "POST", FORK, {"chain_id": "known", "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("fork malformed json", "POST", FORK, '{"chain_id": ', 400, "json_invalid", None),
    ("fork json array", "POST", FORK, "[1]", 400, None, None),
    ("info unknown chain", "GET", "/v1/chains/nope", None, 404, "chain_not_found", "chain_id"),
    ("drop unknown chain", "DELETE", "/v1/chains/nope", None, 404, "chain_not_found", "chain_id"),
    ("prune reversed range", "POST", PRUNE, {**P, "ranges": [[20, 5]]}, 400, "invalid_value", "ranges"),
    ("prune overlapping ranges", "POST", PRUNE, {**P, "ranges": [[5, 20], [10, 30]]}, 400, "invalid_value", "ranges"),
    ("prune range past the prompt", "POST", PRUNE, {**P, "ranges": [[5, 10**6]]}, 400, "invalid_value", "ranges"),
    ("prune range to the prompt's end", "POST", PRUNE, {**P, "ranges": [[5, 70]]}, 400, None, "ranges"),
    ("prune range past the cache", "POST", PRUNE, {**P, "ranges": [[5, 66]]}, 400, "prune_range_not_cached", "ranges"),
    ("prune no ranges", "POST", PRUNE, {**P, "ranges": []}, 400, "invalid_value", "ranges"),
    ("prune ranges string", "POST", PRUNE, {**P, "ranges": "5-20"}, 400, "invalid_value", "ranges"),
    ("prune range of 3", "POST", PRUNE, {**P, "ranges": [[5, 20, 30]]}, 400, "invalid_value", None),
    ("prune range of floats", "POST", PRUNE, {**P, "ranges": [[5.5, 20]]}, 400, "invalid_value", None),
    ("prune negative keep_tokens", "POST", PRUNE, {**P, "keep_tokens": -1}, 400, "invalid_value", "keep_tokens"),
    ("prune keep_tokens string", "POST", PRUNE, {**P, "keep_tokens": "2"}, 400, "invalid_value", "keep_tokens"),
    ("prune keep_tokens float", "POST", PRUNE, {**P, "keep_tokens": 2.5}, 400, "invalid_value", "keep_tokens"),
    (
        "prune no keep_tokens",
        "POST",
        PRUNE,
        {"prompt": HISTORY, "ranges": [[5, 20]]},
        400,
        "missing_required_parameter",
        "keep_tokens",
    ),
    ("prune unknown policy", "POST", PRUNE, {**P, "policy": "magic"}, 400, "invalid_value", "policy"),
    (
        "prune zero window",
        "POST",
        PRUNE,
        {**P, "observation_window_size": 0},
        400,
        "invalid_value",
        "observation_window_size",
    ),
    (
        "prune zero kvzip chunk",
        "POST",
        PRUNE,
        {**P, "policy": "kvzip_global", "kvzip_score_chunk_size": 0},
        400,
        "invalid_value",
        "kvzip_score_chunk_size",
    ),
    ("prune uncached prompt", "POST", PRUNE, {**P, "prompt": _tokens(70, 9)}, 400, "prune_nothing_cached", "prompt"),
    ("prune onto a taken id", "POST", PRUNE, {**P, "chain_id": "known"}, 400, "chain_exists", "chain_id"),
    ("prune empty prompt", "POST", PRUNE, {**P, "prompt": []}, 400, None, "prompt"),
    ("prune token out of vocab", "POST", PRUNE, {**P, "prompt": [*HISTORY[:-1], 10**6]}, 400, None, None),
    ("prune prompt number", "POST", PRUNE, {**P, "prompt": 7}, 400, "invalid_value", "prompt"),
]


def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(dense):
    """Each case of ``BAD`` (one test: the suite's per-test cleanup costs more than a case), each followed
    by good requests: a chain's info, a prune and a drop, a completion."""
    for case, method, path, body, status, code, param in BAD:
        content = None if body is None else body if isinstance(body, str) else json.dumps(body)
        r = httpx.request(
            method, dense.url + path, content=content, headers={"content-type": "application/json"}, timeout=60
        )
        _error(r, status, code, param, case)
        assert httpx.get(dense.url + "/v1/chains/known", timeout=60).json()["busy"] is False, case
        good = httpx.post(dense.url + PRUNE, json=P, timeout=60)
        assert good.status_code == 200, (case, good.text)
        assert httpx.delete(dense.url + "/v1/chains/" + good.json()["chain_id"], timeout=60).json()["deleted"], case
        assert dense.complete([5, 6, 7], max_tokens=1)["usage"]["completion_tokens"] == 1, case
