#!/usr/bin/env bash
# Session 15 call 1: Quest's page summaries as int8 codes with a scale per (page, KV head). page_bounds over
# bf16 summaries vs int8 codes (microbenchmark, batch 5 and 8, with sweeps); the GPU tests of the summary
# kernels and of Quest over fp8 (session 14, never run on a GPU); then the engine at batch 5, 128K: dense,
# Quest-2048 with model-dtype summaries, Quest-2048 with int8 codes (the new default), side by side.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 120 python3 benchmarks/quest_select_probe.py --batches 5,8 --page-bounds-only --json $OUT/pb.json > $OUT/pb.txt 2>&1; grep -v -i warn $OUT/pb.txt | tail -40
timeout 150 python3 -m pytest -q -x -m 'gpu or not gpu' packages/sparse-kernels/tests/test_summary_codes.py packages/sparse-kernels/tests/test_page_bounds.py packages/sparse-kernels/tests/test_summary_update.py packages/sparse-kernels/tests/test_block_summary.py "tests/test_quantized_kv_engine.py::test_cuda_graphs_and_pipelining_equal_eager_and_track_the_cpu_reference" tests/test_mla_quest.py > $OUT/gpu_tests.txt 2>&1; tail -5 $OUT/gpu_tests.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 3)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 80 "${B[@]}" --timed-steps 384 --out $OUT/b5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 70 "${B[@]}" "${Q[@]}" --quest-summary-dtype model --timed-steps 384 --out $OUT/b5 --append > $OUT/quest_model.txt 2>&1; tail -1 $OUT/quest_model.txt
timeout 70 "${B[@]}" "${Q[@]}" --timed-steps 384 --out $OUT/b5 --append > $OUT/quest_int8.txt 2>&1; tail -1 $OUT/quest_int8.txt
grep "^|" $OUT/b5/bench.md | grep -v -- "---"
python3 - <<PY
import json
d = json.load(open("$OUT/b5/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]; m = r["metrics"]
        print(r["sparse_method"], raw["batch_size"], "steps", len(s), "ms", round(m["ms_per_step"], 3), "median", round(m["ms_per_step_median"], 3), "tok/s", round(m["tokens_per_s"], 1), "copy", round(m["fraction_of_copy_bw"], 3), "GB", round(m.get("bytes_per_step", 0) / 1e9, 2) if m.get("bytes_per_step") else None, "busy", raw.get("gpu_kernel_ms_per_step"), "long", sorted(round(x * 1e3, 1) for x in s)[-4:])
        for k in raw.get("gpu_kernels_top", [])[:8]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
