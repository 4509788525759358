"""The engine in a process of its own (``EngineProcess``, what ``sparse-serve serve`` runs): same answers
as offline generation, chain calls cross the process boundary, and a dead engine stops the server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from tiny_models import DEFAULT_MODEL

from sparse_serve import LLM, EngineConfig, SamplingParams
from sparse_serve.server import ServerConfig
from sparse_serve.server.background import BackgroundServer
from sparse_serve.server.engine_process import EngineProcess

MODEL = "tiny-retrieval"
ENGINE = dict(model=str(DEFAULT_MODEL), device="cpu", max_model_len=256, num_kv_blocks=128, block_size=16)
QUIET = dict(port=0, access_log=False, log_level="warning", graceful_shutdown_s=5)


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(EngineProcess(EngineConfig(**ENGINE)), ServerConfig(**QUIET)) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


def _wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_the_engine_runs_in_another_process(server):
    pid = server.app.state.server.engine.pid
    assert pid != os.getpid() and os.path.exists(f"/proc/{pid}")


def test_answers_equal_offline(server, offline):
    body = {"model": MODEL, "prompt": ["def f(x):", "import re"], "max_tokens": 8, "temperature": 0, "logprobs": 1}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    refs = offline.generate(body["prompt"], SamplingParams(max_tokens=8, temperature=0, logprobs=1))
    assert [c["text"] for c in out["choices"]] == [r.text for r in refs]
    logprobs = [e.logprob for e in refs[0].logprobs]  # batched with another prompt here: float noise only
    assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    stream = {**body, "prompt": "def f(x):", "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=stream, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == refs[0].text
    assert events[-1]["usage"]["completion_tokens"] == len(refs[0].token_ids)


def test_chain_calls_cross_the_process(server):
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 3, "chain_id": "p-1"}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    fork = httpx.post(server.url + "/v1/chains/fork", json={"chain_id": "p-1", "new_chain_id": "p-2"}).json()
    assert fork["chain_id"] == "p-2" and fork["num_tokens"] > 0
    missing = httpx.get(server.url + "/v1/chains/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "chain_not_found"
    bad = httpx.post(server.url + "/v1/completions", json={**body, "chain_append_start": 10**6})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chain_append_start"
    for chain in ("p-1", "p-2"):
        assert httpx.delete(server.url + f"/v1/chains/{chain}").status_code == 200


def test_disconnect_aborts_in_the_engine_process(server):
    body = {"model": MODEL, "prompt": "class A:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        next(r.iter_lines())
    metric = "sparse_requests_running"
    _wait_for(lambda: f"{metric} 0" in httpx.get(server.url + "/metrics").text)
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow  # the CLI test below covers it, with the exit status
def test_a_killed_engine_process_fails_requests_and_stops_the_server():
    engine = EngineProcess(EngineConfig(**ENGINE))
    with BackgroundServer(engine, ServerConfig(**QUIET)) as srv:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "engine_unavailable" in rest[-2]
        _wait_for(lambda: not srv.running)
        assert "exited" in srv.fatal_error


def test_serve_exits_nonzero_when_its_engine_dies():
    """Regression (issue 20): a dead engine left the server up answering 503 forever; a supervisor
    could not see it. Now ``sparse-serve serve`` exits with status 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sparse_serve.cli", "serve", "--port", str(port), "--device", "cpu"]
    cmd += ["--max-model-len", "256", "--num-kv-blocks", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    log = []
    watchdog = threading.Timer(180, proc.kill)  # bounds the blocking reads below
    watchdog.start()
    try:
        for line in proc.stdout:  # the startup log names the engine's process
            log.append(line)
            if m := re.search(r"engine in process (\d+)", line):
                engine_pid = int(m[1])
                break
        else:
            pytest.fail("".join(log))
        _wait_for(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, timeout_s=60)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine_pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        # The open stream ends with an error event, then the server exits with status 1.
        assert rest[-1] == "data: [DONE]" and "engine_unavailable" in rest[-2]
        assert proc.wait(timeout=30) == 1
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_on_cpu_the_engine_leaves_the_server_a_core(monkeypatch):
    """Measured: with every core running the engine's OpenMP threads, a 2-core machine's steps got
    ~20x slower under 32 streams (the server's event loop and the spinning threads preempt each other)."""
    import torch

    from sparse_serve.server import engine_worker

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(engine_worker.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    engine_worker._leave_a_core_to_the_server(EngineConfig(**ENGINE))
    assert calls == [1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
    engine_worker._leave_a_core_to_the_server(EngineConfig(**ENGINE))
    assert calls == [1]
