"""The serving benchmark's client and statistics, against an in-process server (a few requests)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import pytest
from tiny_models import DEFAULT_MODEL

from sparse_serve import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.server.background import BackgroundServer

_PATH = Path(__file__).resolve().parents[1] / "benchmarks/serving/bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_percentile_matches_linear_interpolation(bench):
    assert bench.percentile([], 50) is None
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile(list(range(101)), 90) == 90


def test_poisson_workload_is_seeded_and_shaped(bench):
    a = bench.make_workload(200, [8, 16], [4], 5.0, 4000, seed=1)
    assert a == bench.make_workload(200, [8, 16], [4], 5.0, 4000, seed=1)
    starts = [t for t, _, _ in a]
    assert starts == sorted(starts) and starts[0] == 0.0
    assert 200 / 5.0 * 0.7 < starts[-1] < 200 / 5.0 * 1.3  # mean gap 1 / rate
    assert {len(p) for _, p, _ in a} == {8, 16} and all(100 <= t < 4000 for _, p, _ in a for t in p)
    assert all(t == 0.0 for t, _, _ in bench.make_workload(5, [8], [4], math.inf, 4000, seed=1))


def test_run_against_a_server(bench):
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_MODEL), device="cpu", max_model_len=128, num_kv_blocks=32))
    with BackgroundServer(engine) as server:
        workload = bench.make_workload(6, [8, 20], [3, 5], 50.0, 4000, seed=0)
        records, duration = asyncio.run(bench.run_rate(server.url, "tiny-retrieval", workload, workload[:1]))
        counters = bench.server_metrics(server.url)
    summary = bench.summarize(records, duration)
    assert summary["completed"] == 6 and not summary["errors"]
    assert summary["output_tokens"] == sum(n for _, _, n in workload)
    assert all(len(r["itls"]) == r["output_len"] - 1 for r in records)
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p99"] >= summary["itl_ms"]["p50"]
    assert counters["sparse_generation_tokens_total"] == summary["output_tokens"] + workload[0][2]
    table = bench.markdown([{"request_rate": 50.0, "summary": summary}])
    assert table.count("\n") == 3 and "| 50.0 | 6 | 6 |" in table
