"""``sparse-serve bench`` prefill, end-to-end and profiling on the CPU with the embedded tiny model:
the FLOP count against a hand computation, real prefill timed with the whole batch decoding
afterwards, the HF prefill baseline, the profiled chunk, and the end-to-end mode (dense vs SnapKV)."""

from __future__ import annotations

import json

import pytest
import torch

from sparse_models import ModelConfig, read_model_config
from sparse_serve.bench.command import DEFAULT_BENCH_MODEL
from sparse_serve.bench.flops import prefill_flops
from sparse_serve.cli import DEFAULT_MODEL, main
from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.sampling_params import SamplingParams

PROMPT, OUTPUT, CHUNK, BLOCKS = 100, 5, 64, 48

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 12,
    "num_hidden_layers": 3,
    "vocab_size": 10,
}


def test_prefill_flops_by_hand():
    cfg = ModelConfig.from_hf_dict(TINY)
    # a chunk of 3 tokens after 5 cached ones; per token and layer: q 2*8*8=128, k and v 2*8*4=64 each,
    # o 2*8*8=128 -> 384; MLP gate/up/down 3*2*8*12 = 576; attention: query i sees 5+i keys, 6+7+8 = 21
    # pairs, QK^T and PV 2*2*4 FLOPs per pair and head, 2 heads -> 672 per layer; LM head 2*8*10 = 160
    f = prefill_flops(cfg, 3, 5)
    assert (f.projections, f.mlp, f.attention, f.lm_head) == (3 * 3 * 384, 3 * 3 * 576, 3 * 672, 160)
    assert f.total == 3456 + 5184 + 2016 + 160
    assert prefill_flops(cfg, 3, 5, last_chunk=False).lm_head == 0
    # chunking does not change the work of a prompt (the LM head runs once, after the last chunk)
    chunks = [prefill_flops(cfg, c, p, last_chunk=p + c == 20).total for p, c in ((0, 7), (7, 7), (14, 6))]
    assert sum(chunks) == prefill_flops(cfg, 20).total


def test_prefill_flops_sliding_window_caps_each_query():
    cfg = ModelConfig.from_hf_dict({**TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 6})
    dense = ModelConfig.from_hf_dict(TINY)
    assert cfg.layer_sliding_windows == (6, 6, 6)
    for c, p in ((3, 0), (3, 2), (5, 3), (4, 9), (20, 0)):
        pairs = sum(min(n, 6) for n in range(p + 1, p + c + 1))  # query n sees n keys, at most 6
        assert prefill_flops(cfg, c, p).attention == 3 * 2 * 2 * 4 * 2 * pairs
        assert prefill_flops(cfg, c, p).projections == prefill_flops(dense, c, p).projections
    assert prefill_flops(cfg, 3, 2).attention == prefill_flops(dense, 3, 2).attention  # within the window


def test_prefill_flops_of_the_qwen3_8b_shape():
    # issue 16: 128K prefill in 20.9 s is "about 330 TFLOP/s" counting attention and projections
    f = prefill_flops(read_model_config(DEFAULT_BENCH_MODEL), 131072)
    assert f.total / 20.9 / 1e12 == pytest.approx(329.5, abs=0.5)
    assert f.attention / f.total == pytest.approx(0.736, abs=0.001)


def _bench(tmp_path, *extra: str, device: str = "cpu") -> dict:
    argv = ["bench", "--model", str(DEFAULT_MODEL), "--device", device, "--num-kv-blocks", str(BLOCKS)]
    argv += ["--prompt-len", str(PROMPT), "--output-len", str(OUTPUT), "--warmup-steps", "1"]
    argv += ["--max-num-seqs", "32", "--out", str(tmp_path), "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads((tmp_path / "bench.json").read_text())


def test_real_prefill_is_timed_and_the_whole_batch_decodes(tmp_path):
    # chunks of 64 < prompt 100: without holding decodes, early requests decode (and finish) while
    # later ones still prefill, so the timed steps would run with part of the batch; pipelined decode
    # steps (async scheduling) as on the GPU
    report = _bench(
        tmp_path,
        *("--prefill", "real", "--batch-size", "1,max", "--max-num-batched-tokens", str(CHUNK)),
        *("--hf-baseline", "--hf-steps", "2", "--profile-prefill", "--async-scheduling"),
    )
    (inv,) = report["invocations"]
    hf, one, full = inv["runs"]
    cfg = read_model_config(DEFAULT_MODEL)
    assert full["batch_size_arg"] == "max" and full["batch_size"] > 1
    assert full["raw"]["async_scheduling"] and full["raw"]["pipelined_steps"] > 0  # decode steps pipelined
    for run in (one, full):
        b, m, raw, p = run["batch_size"], run["metrics"], run["raw"], run["prefill_metrics"]
        assert raw["running"] == [b] * m["steps_timed"] and m["min_running"] == m["max_running"] == b
        assert raw["tokens"] == [b] * m["steps_timed"] and m["steps_timed"] == OUTPUT - 2
        assert raw["prefill_steps"] == -(-b * PROMPT // CHUNK)  # prefill only: chunks packed back to back
        assert raw["prefix_hit_tokens"] == 0  # no prompt repeats another's prefix
        assert p["tokens"] == b * PROMPT and p["seconds"] == raw["prefill_seconds"] > 0
        assert p["flops"] == b * prefill_flops(cfg, PROMPT).total
        assert p["tflops_per_s"] == pytest.approx(p["flops"] / p["seconds"] / 1e12)
    hp = hf["prefill_metrics"]
    assert hp["seconds"] > 0 and hp["flops"] == prefill_flops(cfg, PROMPT).total and hp["warmup_len"] <= PROMPT
    assert hf["metrics"]["steps_timed"] == 2
    (profile,) = inv["prefill_profiles"]
    assert (profile["prompt_len"], profile["prefix_len"], profile["chunk_tokens"]) == (PROMPT, CHUNK, PROMPT - CHUNK)
    assert profile["device"] == "cpu" and profile["busy_ms"] > 0 and profile["top"]
    assert {"name", "ms_per_step", "calls_per_step"} <= set(profile["top"][0])
    assert profile["flops"] == prefill_flops(cfg, PROMPT - CHUNK, CHUNK).total
    md = (tmp_path / "bench.md").read_text()
    x = one["prefill_metrics"]["tokens_per_s"] / hp["tokens_per_s"]
    assert f"prefill tok/s, dense (async) engine vs HF transformers, batch 1, prompt {PROMPT}: **{x:.2f}x**" in md
    assert "## Prefill" in md and "## Profiled prefill chunks" in md and f"{full['batch_size']} (max)" in md


def test_e2e_dense_vs_snapkv(tmp_path):
    _bench(tmp_path, "--e2e", "3")
    report = _bench(
        tmp_path,
        *("--e2e", "3", "--append", "--sparse-method", "snapkv", "--max-num-batched-tokens", str(CHUNK)),
        *("--sink-keep-tokens", "4", "--decode-keep-tokens", "12", "--recent-keep-tokens", "32"),
    )
    dense, snap = (inv["runs"][0] for inv in report["invocations"])
    assert dense["sparse_method"] == "dense" and snap["sparse_method"] == "snapkv"
    for run in (dense, snap):
        m, raw = run["metrics"], run["raw"]
        assert run["mode"] == "e2e" and run["num_requests"] == 3 and raw["output_tokens"] == [OUTPUT] * 3
        assert all(0 < t <= f for t, f in zip(raw["ttft_s"], raw["finish_s"], strict=True))
        assert m["wall_seconds"] == max(raw["finish_s"]) and m["output_tokens"] == 3 * OUTPUT
        assert m["total_tokens_per_s"] == pytest.approx(3 * (PROMPT + OUTPUT) / m["wall_seconds"])
        assert m["ttft_max_s"] == max(raw["ttft_s"]) and m["mean_itl_ms"] > 0
    x = dense["metrics"]["wall_seconds"] / snap["metrics"]["wall_seconds"]
    md = (tmp_path / "bench.md").read_text()
    assert "## End to end" in md and f"| {x:.2f}x |" in md


def test_held_decodes_run_when_nothing_else_can():
    # the pool holds two of the three requests: holding their decodes until the third is prefilled
    # would stall, so the scheduler decodes them (and the third starts once they are done)
    engine = LLMEngine(
        EngineConfig(model=str(DEFAULT_MODEL), device="cpu", num_kv_blocks=16, max_num_batched_tokens=CHUNK)
    )
    engine.scheduler.hold_decodes = True
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(list(range(i, i + PROMPT)), params) for i in range(3)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.token_ids)
    assert done == dict.fromkeys(ids, OUTPUT) and engine.scheduler.num_preemptions == 0


def test_prefill_table_ratios_pair_same_prompt_and_batch():
    from sparse_serve.bench.report_tables import prefill_table

    def run(engine, tok_s, method="dense", prefill_method=None, batch=1):
        p = {"seconds": 1.0, "tokens_per_s": tok_s, "flops": 4e12, "attention_flops": 1e12, "tflops_per_s": 4.0}
        return {
            "engine": engine,
            "sparse_method": method,
            "prefill_sparse_method": prefill_method,
            "prompt_len": 1000,
            "batch_size": batch,
            "prefill_metrics": p,
        }

    runs = [run("hf-transformers", 100.0), run("sparse-engine", 150.0), run("sparse-engine", 450.0, "dense", "fp")]
    runs += [run("sparse-engine", 400.0, batch=4), run("sparse-engine", 600.0, "snapkv", batch=4)]
    rows = [line.split(" | ") for line in prefill_table(runs).splitlines()[2:]]
    assert [(r[0].strip("| "), r[7], r[8]) for r in rows] == [
        ("HF transformers", "", ""),
        ("dense", "1.50x", ""),
        ("dense + fp prefill", "4.50x", "3.00x"),
        ("dense", "4.00x", ""),
        ("snapkv", "6.00x", "1.50x"),
    ]
    assert all(r[6] == "25.0" for r in rows)  # attention share of the FLOPs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_real_prefill_whole_batch_and_kernel_profile(tmp_path):
    report = _bench(
        tmp_path,
        *("--prefill", "real", "--batch-size", "max", "--max-num-batched-tokens", str(CHUNK)),
        *("--hf-baseline", "--hf-steps", "2", "--profile-prefill"),
        device="cuda",
    )
    (inv,) = report["invocations"]
    hf, full = inv["runs"]
    b, m = full["batch_size"], full["metrics"]
    assert b > 1 and full["raw"]["running"] == [b] * m["steps_timed"] and full["raw"]["cuda_graph_steps"] > 0
    assert full["prefill_metrics"]["tokens"] == b * PROMPT and full["raw"]["prefix_hit_tokens"] == 0
    assert hf["prefill_metrics"]["seconds"] > 0 and hf["prefill_metrics"]["peak_memory_bytes"] > 0
    (profile,) = inv["prefill_profiles"]
    assert profile["device"] == "cuda" and profile["busy_ms"] > 0 and profile["prefix_len"] == CHUNK
    assert profile["top"] and all(k["ms_per_step"] > 0 for k in profile["top"])
