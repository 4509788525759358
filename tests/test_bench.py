"""``sparse-serve bench`` on the CPU with the embedded tiny model: it runs, writes its report, and
its numbers are consistent with the shapes it was given (the GPU numbers live in results/bench)."""

from __future__ import annotations

import json

import pytest
import torch

from sparse_methods import get_method_class
from sparse_serve.bench.decode import max_batch_size
from sparse_serve.bench.probes import kv_bytes_per_token, weight_bytes_per_step
from sparse_serve.cli import DEFAULT_MODEL, main
from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine

PROMPT, OUTPUT, WARMUP, BLOCKS = 100, 5, 1, 48


def _bench(tmp_path, *extra: str) -> dict:
    argv = ["bench", "--model", str(DEFAULT_MODEL), "--device", "cpu", "--num-kv-blocks", str(BLOCKS)]
    argv += ["--prompt-len", str(PROMPT), "--output-len", str(OUTPUT), "--warmup-steps", str(WARMUP)]
    argv += ["--max-num-seqs", "32", "--out", str(tmp_path), "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads((tmp_path / "bench.json").read_text())


def test_bench_writes_report_with_consistent_numbers(tmp_path):
    report = _bench(tmp_path, "--batch-size", "1,2,max", "--hf-baseline", "--hf-steps", "2")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 0
    md = (tmp_path / "bench.md").read_text()
    assert "dense engine vs HF transformers, batch 1" in md and "sparse-serve bench" in md
    (inv,) = report["invocations"]
    assert inv["copy_bandwidth"]["bytes_per_s"] > 0 and inv["environment"]["torch"] == torch.__version__
    hf, *runs = inv["runs"]
    assert hf["engine"] == "hf-transformers" and hf["metrics"]["steps_timed"] == 2
    assert [r["batch_size_arg"] for r in runs] == [1, 2, "max"]
    shape = runs[0]["model_shape"]
    layers = shape["num_hidden_layers"]
    blocks_per_req = -(-(PROMPT + OUTPUT) // runs[0]["block_size"])
    assert runs[-1]["batch_size"] == BLOCKS // blocks_per_req
    for run in runs:
        m, raw, b = run["metrics"], run["raw"], run["batch_size"]
        assert m["steps_timed"] == OUTPUT - WARMUP and m["min_running"] == b
        assert sum(raw["tokens"]) == b * m["steps_timed"]
        assert m["tokens_per_s"] == pytest.approx(b / (m["ms_per_step"] / 1e3))
        # before timed step j every request holds PROMPT + WARMUP + j - 1 slots per layer, and reads one more
        assert raw["kv_slots_read"] == [b * layers * (PROMPT + WARMUP + j) for j in range(m["steps_timed"])]
        assert raw["kv_bytes_per_slot"] == kv_bytes_per_token(
            1, shape["num_key_value_heads"], shape["head_dim"], torch.float32
        )
        assert 0 < m["fraction_of_copy_bw"] and m["bytes_per_step"] > m["weight_bytes_per_step"] > 0
        assert raw["kv_bytes_in_use"] == b * blocks_per_req * run["kv_bytes_per_block"]
        assert raw["stalls"]["allocator"] == {} and isinstance(raw["stalls"]["gc"], dict)  # CPU: no allocator
        assert raw["host_threads"] == torch.get_num_threads()  # a CPU engine leaves torch's threads
        assert run["cascade_plans"]["built"] == 0  # no cuDNN plans to build off CUDA
    assert hf["metrics"]["weight_bytes_per_step"] == runs[0]["metrics"]["weight_bytes_per_step"]


def test_bench_appends_methods_and_reports_ratio_to_dense(tmp_path):
    _bench(tmp_path, "--batch-size", "max")
    report = _bench(
        tmp_path,
        *("--batch-size", "max", "--sparse-method", "snapkv", "--append", "--prefill", "real"),
        *("--sink-keep-tokens", "4", "--decode-keep-tokens", "12", "--recent-keep-tokens", "32"),
    )
    dense, snap = (inv["runs"][0] for inv in report["invocations"])
    assert snap["prefill"] == "real" and snap["prefill_policy"] == str(get_method_class("snapkv").prefill_policy)
    assert snap["method_params"]["decode_keep_tokens"] == 12
    assert snap["batch_size"] > dense["batch_size"]  # eviction turns into admission capacity
    assert "snapkv at batch" in (tmp_path / "bench.md").read_text()


def test_max_batch_follows_the_memory_plan():
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_MODEL), device="cpu", num_kv_blocks=1000, max_num_seqs=500))
    # dense: prompt + output slots, rounded up to whole blocks of 16
    assert max_batch_size(engine, 1000, 24) == 1000 // 64
    assert max_batch_size(engine, 8, 8) == 500  # capped at max_num_seqs
    with pytest.raises(ValueError):
        max_batch_size(engine, 16000, 1)
    params = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    assert weight_bytes_per_step(engine.runner.model) == params  # tied embeddings: the LM head reads them all


def test_bench_counts_layer_blocks_as_one_layer(tmp_path):
    """With a table per layer (PyramidKV) a pool id is one layer's block: bytes in use are those
    blocks' bytes, so they fall below dense's prompt (they read 36x too high before)."""
    report = _bench(
        tmp_path,
        *("--batch-size", "1", "--sparse-method", "pyramidkv", "--decode-eviction-interval", "0"),
        *("--sink-keep-tokens", "4", "--decode-keep-tokens", "28", "--recent-keep-tokens", "32"),
    )
    (run,) = report["invocations"][0]["runs"]
    layers = run["model_shape"]["num_hidden_layers"]
    dense_bytes = -(-(PROMPT + OUTPUT) // run["block_size"]) * run["kv_bytes_per_block"]
    in_use = run["raw"]["kv_bytes_in_use"]
    assert in_use % (run["kv_bytes_per_block"] // layers) == 0
    assert 0 < in_use < dense_bytes


def test_label_names_the_store_scheme_after_its_summaries():
    from sparse_serve.bench.report_tables import label

    store = "quantized paged + block summaries (int8 codes) (fp8, 8 bits)"
    assert label(dict(engine="sparse-engine", sparse_method="quest", kv_store=store)) == "quest [fp8, 8 bits]"
    plain = dict(engine="sparse-engine", sparse_method="kivi", kv_store="quantized paged (kivi, 2 bits)")
    assert label(plain) == "kivi [kivi, 2 bits]"


def test_synthetic_bench_runs_one_eviction_round_before_timing():
    """With synthetic prefill and decode-time eviction the bench first steps the same batch through one
    interval (untimed), so the timed batch's first round is not the process's first; the round did observe."""
    from sparse_serve.bench.decode import DecodeCase, run_decode_case

    engine = LLMEngine(
        EngineConfig(
            model=str(DEFAULT_MODEL),
            device="cpu",
            num_kv_blocks=200,
            sparse_method="snapkv",
            sink_keep_tokens=4,
            decode_keep_tokens=12,
            recent_keep_tokens=32,
            decode_eviction_interval=3,
        )
    )
    rounds = []
    prepare = engine.method.prepare_step
    engine.method.prepare_step = lambda ctx: rounds.append(len(observed := prepare(ctx))) or observed
    raw = run_decode_case(engine, DecodeCase(PROMPT, 2, 8, warmup_steps=1), kv_bytes_per_slot=1, progress=False)
    assert raw["warm_round_steps"] == 5  # interval + 2 steps
    assert 2 in rounds[1:5]  # a decode-time round (both requests observed) after the warm-up's first step
    assert len(raw["step_seconds"]) == 8 - 1
    # no warm-up without decode-time eviction, with a real prefill (it would prefill the batch twice), or when the
    # case's steps end before the interval's first round
    engine.method.prepare_step = prepare
    short = DecodeCase(PROMPT, 2, 8, warmup_steps=1, timed_steps=1)
    assert run_decode_case(engine, short, kv_bytes_per_slot=1, progress=False)["warm_round_steps"] == 0
    assert (
        run_decode_case(engine, DecodeCase(PROMPT, 2, 8, prefill="real"), kv_bytes_per_slot=1, progress=False)[
            "warm_round_steps"
        ]
        == 0
    )
