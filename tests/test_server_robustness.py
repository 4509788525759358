"""The server under bad input, disconnects, a full waiting queue and shutdown: it answers and keeps serving."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from tiny_models import DEFAULT_MODEL

from sparse_serve import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.server import ServerConfig
from sparse_serve.server.background import BackgroundServer

MODEL = "tiny-retrieval"
MAX_LEN = 512
# Room for long requests, so a disconnect or a full queue happens while they still run.
ENGINE = dict(model=str(DEFAULT_MODEL), device="cpu", max_model_len=MAX_LEN, num_kv_blocks=96, block_size=16)
QUIET = dict(port=0, access_log=False, log_level="warning", graceful_shutdown_s=5)


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(**QUIET, max_body_bytes=2**20)
    with BackgroundServer(LLMEngine(EngineConfig(**ENGINE)), config) as srv:
        yield srv


def _metric(url: str, name: str, default: float | None = None) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    if default is None:
        raise KeyError(name)
    return default


ABORTED = 'sparse_requests_finished_total{finish_reason="abort"}'


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


C = {"model": MODEL, "prompt": "Open the", "max_tokens": 2}  # a good completion body
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD = [
    # (case, path, body (dict, or raw text), status, error code, param)
    ("malformed json", "completions", '{"model": "tiny-retrieval", "prompt": ', 400, "json_invalid", None),
    ("json array", "completions", "[1, 2]", 400, None, None),
    ("empty body", "completions", "", 400, "json_invalid", None),
    ("max_tokens string", "completions", {**C, "max_tokens": "ten"}, 400, "invalid_value", "max_tokens"),
    ("max_tokens numeric string", "completions", {**C, "max_tokens": "5"}, 400, "invalid_value", "max_tokens"),
    ("max_tokens float", "completions", {**C, "max_tokens": 2.5}, 400, "invalid_value", "max_tokens"),
    ("temperature string", "completions", {**C, "temperature": "hot"}, 400, "invalid_value", "temperature"),
    ("prompt number", "completions", {**C, "prompt": 5}, 400, "invalid_value", "prompt"),
    ("messages string", "chat/completions", {**CHAT, "messages": "hi"}, 400, "invalid_value", "messages"),
    ("bad role", "chat/completions", {**CHAT, "messages": [{"role": "bot", "content": "x"}]}, 400, None, None),
    ("negative max_tokens", "completions", {**C, "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ("zero max_tokens", "completions", {**C, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("huge max_tokens", "completions", {**C, "max_tokens": 10**9}, 400, "context_length_exceeded", "max_tokens"),
    ("enormous max_tokens", "completions", {**C, "max_tokens": 10**40}, 400, "context_length_exceeded", None),
    ("huge max_completion_tokens", "chat/completions", {**CHAT, "max_completion_tokens": 10**6}, 400, None, None),
    ("unknown model", "completions", {**C, "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("unknown model chat", "chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("token prompt too long", "completions", {**C, "prompt": [5] * MAX_LEN}, 400, "context_length_exceeded", "prompt"),
    (
        "text prompt too long",
        "completions",
        {**C, "prompt": "word " * 2 * MAX_LEN},
        400,
        "context_length_exceeded",
        None,
    ),
    (
        "chat too long",
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "a " * (MAX_LEN + 10)}]},
        400,
        None,
        None,
    ),
    ("unknown field", "completions", {**C, "frobnicate": True}, 400, "unknown_parameter", "frobnicate"),
    ("unknown chat field", "chat/completions", {**CHAT, "best_of": 2}, 400, "unknown_parameter", "best_of"),
    ("unknown message field", "chat/completions", {**CHAT, "messages": [{"role": "user", "x": 1}]}, 400, None, None),
    ("missing model", "completions", {"prompt": "x"}, 400, "missing_required_parameter", "model"),
    ("missing prompt", "completions", {"model": MODEL}, 400, "missing_required_parameter", "prompt"),
    ("empty messages", "chat/completions", {**CHAT, "messages": []}, 400, None, "messages"),
    ("empty prompt", "completions", {**C, "prompt": ""}, 400, None, "prompt"),
    ("token out of vocab", "completions", {**C, "prompt": [1, 2, 10**6]}, 400, None, "prompt"),
    ("empty prompt in a batch", "completions", {**C, "prompt": ["a", ""]}, 400, None, "prompt"),
    ("too many choices", "completions", {**C, "prompt": ["a"] * 40, "n": 2}, 400, None, "n"),
    ("n float", "completions", {**C, "n": 1e6}, 400, "invalid_value", "n"),
    ("n huge", "completions", {**C, "n": 10**6}, 400, "invalid_value", "n"),
    ("best_of above n", "completions", {**C, "best_of": 3}, 400, "unsupported_parameter", "best_of"),
    ("logprobs above 5", "completions", {**C, "logprobs": 6}, 400, "invalid_value", "logprobs"),
    ("top_logprobs above 20", "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, None, None),
    ("top_logprobs alone", "chat/completions", {**CHAT, "top_logprobs": 2}, 400, None, "top_logprobs"),
    ("penalty above 2", "completions", {**C, "frequency_penalty": 2.5}, 400, "invalid_value", "frequency_penalty"),
    ("repetition_penalty 0", "completions", {**C, "repetition_penalty": 0}, 400, None, "repetition_penalty"),
    ("logit_bias word key", "completions", {**C, "logit_bias": {"abc": 1}}, 400, None, "logit_bias"),
    ("logit_bias out of vocab", "completions", {**C, "logit_bias": {"99999999": 1}}, 400, None, "logit_bias"),
    ("logit_bias too large", "completions", {**C, "logit_bias": {"5": 1000}}, 400, None, "logit_bias"),
    ("min_tokens above max_tokens", "completions", {**C, "min_tokens": 5}, 400, "invalid_value", "min_tokens"),
    ("tools", "chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "unsupported_parameter", "tools"),
    (
        "json mode",
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}},
        400,
        "unsupported_parameter",
        "response_format",
    ),
    ("bad chat template", "chat/completions", {**CHAT, "chat_template": "{% if %}"}, 400, None, "chat_template"),
    (
        "image part",
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        None,
        None,
    ),
    (
        "chain_append_start alone",
        "chat/completions",
        {**CHAT, "chain_append_start": 3},
        400,
        None,
        "chain_append_start",
    ),
    (
        "append to an unknown chain",
        "completions",
        {**C, "chain_id": "no-such-chain", "chain_append_start": 3},
        404,
        "chain_not_found",
        "chain_id",
    ),
    ("temperature > 2", "completions", {**C, "temperature": 5}, 400, "invalid_value", "temperature"),
    ("top_p 0", "completions", {**C, "top_p": 0}, 400, "invalid_value", "top_p"),
    ("empty stop string", "completions", {**C, "stop": [""]}, 400, "invalid_value", "stop"),
    (
        "bad continuous usage",
        "completions",
        {**C, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
        400,
        None,
        None,
    ),
    ("seed out of range", "completions", {**C, "seed": 2**70}, 400, "invalid_value", "seed"),
    ("stream_options without stream", "completions", {**C, "stream_options": {"include_usage": True}}, 400, None, None),
    ("body too large", "completions", {**C, "prompt": "x" * 2**21}, 413, "body_too_large", None),
]


@pytest.mark.parametrize("case, path, body, status, code, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server, case, path, body, status, code, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    good = httpx.post(f"{server.url}/v1/{path}", json=CHAT if path.startswith("chat") else C)
    assert good.status_code == 200, good.text


def test_standard_fields_at_neutral_values_are_accepted(server):
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "user": "u", "n": 1, "seed": 1}
    r = httpx.post(server.url + "/v1/completions", json={**C, **neutral, "echo": False, "best_of": 1, "logprobs": None})
    assert r.status_code == 200, r.text
    chat = {
        **neutral,
        "metadata": {"k": "v"},
        "store": False,
        "tool_choice": "none",
        "response_format": {"type": "text"},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **chat, "logprobs": False})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)])
def test_unknown_routes_answer_in_openai_shape(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status and r.json()["error"]["message"]
    if status == 405:  # regression (issue 20): the Allow header was dropped
        assert r.headers["allow"] == "POST"


def test_out_of_range_chain_append_start_names_its_field(server):
    assert httpx.post(server.url + "/v1/completions", json={**C, "chain_id": "c-range"}).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={**C, "chain_id": "c-range", "chain_append_start": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chain_append_start"
    assert httpx.delete(server.url + "/v1/chains/c-range").status_code == 200


def test_tiny_temperature_and_top_p_do_not_take_generation_down(server):
    """Regression (issue 20): temperature 1e-40 or top_p 1e-46 made the sampler raise on the engine
    thread, and from then on every request and /health answered 503."""
    for extra in ({"temperature": 1e-40}, {"temperature": 1e-38, "top_p": 1e-46}, {"top_p": 5e-324}):
        r = httpx.post(server.url + "/v1/completions", json={**C, "max_tokens": 4, **extra})
        assert r.status_code == 200, r.text
    greedy = httpx.post(server.url + "/v1/completions", json={**C, "max_tokens": 4, "temperature": 0}).json()
    tiny = httpx.post(server.url + "/v1/completions", json={**C, "max_tokens": 4, "temperature": 1e-40}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]  # below 1e-5 is greedy
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={**C, "temperature": 1.0}).status_code == 200


def test_a_huge_text_prompt_is_refused_at_once_and_stalls_nobody():
    """Regression (issue 20): a 30 MB prompt (under the 32 MiB body limit) was tokenized whole before the
    length check, stalling every connection for ~30 s. Now its length alone refuses it."""
    engine = LLMEngine(EngineConfig(**ENGINE))
    with BackgroundServer(engine, ServerConfig(**QUIET)) as srv:
        huge = {**C, "prompt": "word " * (6 * 2**20)}  # 30 MiB of text
        payload = json.dumps(huge).encode()
        started = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", content=payload, headers={"content-type": "application/json"})
        elapsed = time.monotonic() - started
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == "prompt"
        assert elapsed < 5.0, f"refusing a 30 MB prompt took {elapsed:.1f} s"
        chat = {**CHAT, "messages": [{"role": "user", "content": "word " * (6 * 2**20)}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert httpx.get(srv.url + "/health", timeout=2).status_code == 200


def test_stream_disconnect_aborts_and_frees_kv(server):
    baseline = _metric(server.url, "sparse_kv_blocks_used")
    aborted = _metric(server.url, ABORTED, default=0)
    body = {**C, "prompt": "def main():", "max_tokens": MAX_LEN - 20, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _metric(server.url, "sparse_kv_blocks_used") > baseline
        assert _metric(server.url, "sparse_requests_running") == 1
    # The client closed the connection mid-stream: the request is aborted and its blocks return.
    _wait_for(lambda: _metric(server.url, "sparse_requests_running") == 0)
    _wait_for(lambda: _metric(server.url, "sparse_kv_blocks_used") == baseline)
    assert _metric(server.url, ABORTED) == aborted + 1


def test_non_stream_disconnect_aborts_and_frees_kv(server):
    baseline = _metric(server.url, "sparse_kv_blocks_used")
    body = {**C, "prompt": "class A:", "max_tokens": MAX_LEN - 20, "ignore_eos": True}
    aborted = _metric(server.url, ABORTED, default=0)
    with socket.create_connection(_addr(server.url)) as sock:  # a raw client that leaves mid-request
        payload = json.dumps(body).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        _wait_for(lambda: _metric(server.url, "sparse_requests_running") == 1)
    _wait_for(lambda: _metric(server.url, "sparse_requests_running") == 0)
    _wait_for(lambda: _metric(server.url, "sparse_kv_blocks_used") == baseline)
    assert _metric(server.url, ABORTED) == aborted + 1


def _addr(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    return u.host, u.port


def test_full_waiting_queue_answers_503():
    engine = LLMEngine(EngineConfig(**{**ENGINE, "max_num_seqs": 1}))
    with BackgroundServer(engine, ServerConfig(**QUIET, max_waiting_requests=1)) as srv:
        long = {**C, "max_tokens": MAX_LEN - 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=long) as running:
            lines = running.iter_lines()  # keep a reference: a collected iterator closes the response
            next(lines)  # the first request runs (max_num_seqs=1)
            with httpx.stream("POST", srv.url + "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # accepted; it waits for the running one
                r = httpx.post(srv.url + "/v1/completions", json=C)
                assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
                assert r.headers["retry-after"] == "1"
                assert _metric(srv.url, 'sparse_requests_rejected_total{reason="queue_full"}') == 1
        # Both closed: once the server has seen the disconnects and aborted them, the queue has room again.
        _wait_for(lambda: _metric(srv.url, "sparse_requests_waiting") == 0)
        _wait_for(lambda: _metric(srv.url, "sparse_requests_running") == 0)
        assert httpx.post(srv.url + "/v1/completions", json=C).status_code == 200


def test_shutdown_drains_in_flight_streams_then_exits(tmp_path):
    """``sparse-serve serve`` on Ctrl-C: an open stream finishes, the engine thread stops, exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sparse_serve.cli", "serve", "--port", str(port), "--device", "cpu"]
    cmd += ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-waiting-requests", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _healthy(url) or proc.poll() is not None, timeout_s=120)
        assert proc.poll() is None, proc.stdout.read()
        body = {**C, "max_tokens": 60, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            events.append(next(lines))
            proc.send_signal(signal.SIGINT)
            events += [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert len(chunks) == 60 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Application shutdown complete" in proc.stdout.read()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_engine_failure_fails_requests_and_stops_the_server():
    engine = LLMEngine(EngineConfig(**ENGINE))
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected engine fault")
        return real_step()

    engine.step = failing_step
    with BackgroundServer(engine, ServerConfig(**QUIET)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={**C, "max_tokens": 20, "ignore_eos": True})
        assert r.status_code == 503 and "injected engine fault" in r.json()["error"]["message"]
        # The engine is dead: the server stops instead of answering 503 forever (run_server exits 1).
        _wait_for(lambda: not srv.running)
        assert "injected engine fault" in srv.fatal_error


def test_a_request_that_fails_alone_gets_an_error_and_the_others_go_on(server, monkeypatch):
    engine = server.app.state.server.engine.engine  # the LLMEngine on the server's engine thread
    real = engine._append_token

    def fails_when_marked(req, *args, **kwargs):  # a fault in one request's own postprocessing
        if 4095 in req.sampling_params.stop_token_ids:
            raise RuntimeError("injected request fault")
        return real(req, *args, **kwargs)

    monkeypatch.setattr(engine, "_append_token", fails_when_marked)
    marked = {**C, "stop_token_ids": [4095], "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=marked)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    assert "injected request fault" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**marked, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and "request_failed" in events[-2]
    assert httpx.post(server.url + "/v1/completions", json=C).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
