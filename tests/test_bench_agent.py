"""``sparse-serve bench-agent`` on the CPU with a tiny random Llama: every turn of every session
completes, dense + radix hits the history it resubmitted, SnapKV + chain resumes each chain's
processed history and prefills only the new tokens, and the report holds the fields (the GPU numbers
live in results/agent)."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
import torch

from sparse_serve.cli import main

BLOCK, SYSTEM, TASK, TOOL, OUT, TURNS = 8, 24, 6, (20, 40), 5, 4
SNAPKV = ["--sparse-method", "snapkv", "--sink-keep-tokens", "4", "--decode-keep-tokens", "24"]
SNAPKV += ["--recent-keep-tokens", "16", "--observation-window-size", "8"]
BUDGET = 4 + 24 + 16


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def report(tiny_checkpoint, tmp_path_factory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("agent")
    argv = ["bench-agent", "--model", str(tiny_checkpoint("llama")[0]), "--device", "cpu", "--dtype", "float32"]
    argv += ["--sessions", "2,3", "--turns", str(TURNS), "--system-tokens", str(SYSTEM), "--task-tokens", str(TASK)]
    argv += ["--tool-tokens", "{},{}".format(*TOOL), "--output-tokens", str(OUT), "--block-size", str(BLOCK)]
    argv += ["--max-num-batched-tokens", "32", "--num-kv-blocks", "400", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert main([*argv, "--append", *SNAPKV]) == 0
    return json.loads((out / "agent.json").read_text()), out


def _by_session(run: dict) -> dict[int, list[dict]]:
    sessions: dict[int, list[dict]] = {}
    for t in run["turns"]:
        sessions.setdefault(t["session"], []).append(t)
    return sessions


def _check_every_turn_done(run: dict) -> None:
    s = run["workload"]["num_sessions"]
    sessions = _by_session(run)
    assert sorted(sessions) == list(range(s)) and run["summary"]["num_turns_done"] == s * TURNS
    for turns in sessions.values():
        assert [t["turn"] for t in turns] == list(range(TURNS))
        assert all(t["output_tokens"] == OUT and t["finished"] >= t["first_token"] >= t["submitted"] for t in turns)
        for prev, t in pairwise(turns):
            assert t["submitted"] >= prev["finished"]  # closed loop: the next turn follows the previous one
            assert t["prompt_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] + t["new_tokens"]
            assert TOOL[0] <= t["new_tokens"] <= TOOL[1]


def test_dense_radix_hits_the_resubmitted_history(report):
    dense = report[0]["invocations"][0]["runs"]
    for run in dense:
        assert run["system"] == "dense + radix" and run["summary"]["preemptions"] == 0
        _check_every_turn_done(run)
        for turns in _by_session(run).values():
            assert turns[0]["cached_tokens"] <= SYSTEM // BLOCK * BLOCK
            for prev, t in pairwise(turns):
                history = prev["prompt_tokens"] + prev["output_tokens"]
                # all computed history (the last sampled token has no KV yet) in whole blocks
                assert t["cached_tokens"] == (history - 1) // BLOCK * BLOCK
        for t in run["turns"]:
            assert t["prefilled_tokens"] == t["prompt_tokens"] - t["cached_tokens"] and t["reused_tokens"] == 0
        m = run["summary"]
        assert m["cached_tokens"] == m["prefix_hit_tokens_engine"] > 0
        assert m["prefilled_tokens"] == m["prompt_tokens"] - m["cached_tokens"]


def test_snapkv_chain_resumes_and_prefills_only_new_tokens(report):
    dense, chain = (inv["runs"] for inv in report[0]["invocations"])
    for run, base in zip(chain, dense, strict=True):
        assert run["system"] == "snapkv + chain"
        _check_every_turn_done(run)
        for turns in _by_session(run).values():
            assert turns[0]["chain_status"] == "created" and turns[0]["reused_tokens"] == 0
            for prev, t in pairwise(turns):
                assert t["chain_status"] == "resumed" and t["cached_tokens"] == 0
                assert t["reused_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] - 1
                assert t["prefilled_tokens"] == t["new_tokens"] + 1
        m = run["summary"]
        created = run["workload"]["num_sessions"]
        assert m["chain_status"] == {"created": created, "resumed": m["num_turns_done"] - created}
        assert m["chains_left"] == m["kv_blocks_in_use_after"] == 0
        assert m["max_prompt_tokens"] > BUDGET  # compression really happened on the way
        assert m["prefilled_tokens"] < base["summary"]["prefilled_tokens"]
        assert m["peak_kv_blocks_in_use"] < base["summary"]["peak_kv_blocks_in_use"]


def test_report_has_the_fields(report):
    data, out = report
    dense_inv, chain_inv = data["invocations"]
    assert chain_inv["settings"]["method_params"]["decode_keep_tokens"] == 24
    for inv in data["invocations"]:
        assert {"environment", "settings", "load_seconds", "warmup_seconds", "runs", "command"} <= set(inv)
        assert {"chunk_size", "block_size", "prefill_policy", "num_kv_blocks", "model_shape"} <= set(inv["settings"])
        assert [r["workload"]["num_sessions"] for r in inv["runs"]] == [2, 3]
        assert len({r["workload"]["seed"] for r in inv["runs"]}) == 2  # no prefix shared across runs
        for run in inv["runs"]:
            m = run["summary"]
            for key in ("wall_seconds", "turns_per_s", "output_tokens_per_s", "prefilled_tokens", "ttft_s"):
                assert key in m
            assert set(m["turn_latency_s"]) == set(m["ttft_s"]) == {"mean", "p50", "p90"}
            assert m["output_tokens"] == m["num_turns_done"] * OUT
    md = (out / "agent.md").read_text()
    assert "sparse-serve bench-agent" in md and "matched S=3" in md and "best S" in md
    pytest.importorskip("matplotlib")
    assert (out / "agent.png").stat().st_size > 0


def test_time_estimate_scales_prefill_with_sessions_and_decode_weakly():
    from sparse_serve.bench.agent_command import estimate_seconds

    last = {"workload": {"num_sessions": 8}, "summary": {"wall_seconds": 30.0, "run_seconds_by_kind": {"decode": 10.0}}}
    assert estimate_seconds(last, 32) == pytest.approx(20.0 * 4 + 10.0 * 2)
    assert estimate_seconds(last, 4) == pytest.approx(20.0 * 0.5 + 10.0)
    assert estimate_seconds(last, 8) == pytest.approx(30.0)
