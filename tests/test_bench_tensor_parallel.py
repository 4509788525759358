"""``sparse-serve bench --tensor-parallel-size 2`` on the CPU (two gloo ranks) with the embedded tiny model:
it runs, stops its ranks, and its bytes per step are one GPU's: rank 0's weight shard and its KV heads.
On a CUDA host the same test checks that a CPU engine's ranks talk gloo, not NCCL."""

from __future__ import annotations

import json

import torch

from sparse_models import load_model
from sparse_serve.bench.probes import kv_bytes_per_token, weight_bytes_per_step
from sparse_serve.cli import DEFAULT_MODEL, main

PROMPT, OUTPUT, WARMUP = 16, 4, 1


def test_bench_at_tensor_parallel_2_counts_one_ranks_bytes(tmp_path):
    argv = ["bench", "--model", str(DEFAULT_MODEL), "--device", "cpu", "--tensor-parallel-size", "2"]
    argv += ["--num-kv-blocks", "16", "--prompt-len", str(PROMPT), "--output-len", str(OUTPUT)]
    argv += ["--batch-size", "2", "--warmup-steps", str(WARMUP), "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    (run,) = json.loads((tmp_path / "bench.json").read_text())["invocations"][0]["runs"]
    assert "error" not in run and run["tensor_parallel_size"] == 2
    m, raw, shape = run["metrics"], run["raw"], run["model_shape"]
    assert m["steps_timed"] == OUTPUT - WARMUP and sum(raw["tokens"]) == 2 * m["steps_timed"]
    # a slot is one rank's KV heads (the tiny model's 2 KV heads: one per rank)
    heads = shape["num_key_value_heads"] // 2
    assert raw["kv_bytes_per_slot"] == kv_bytes_per_token(1, heads, shape["head_dim"], torch.float32)
    # weights: a shard of the whole model's (replicated norms whole), not all of them
    model, _ = load_model(DEFAULT_MODEL, dtype=torch.float32, load_format="dummy")
    whole = weight_bytes_per_step(model)
    assert whole / 2 <= m["weight_bytes_per_step"] < whole
    md = (tmp_path / "bench.md").read_text()
    assert "(TP 2, per GPU)" in md
