#!/usr/bin/env bash
# Session 15 call 3: page-bound variants (bf16 / int8 / int8 read as fp16 by the 0x6400 trick / fp8; warps), then the engine at
# batch 5 / 128K side by side: dense, Quest-2048 over int8 codes (the new default), Quest-2048 over model-dtype
# summaries; GPU tests of the page-bound and summary kernels.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 100 python3 pb_variants.py > $OUT/pbv.txt 2>&1; grep -v -i warn $OUT/pbv.txt
timeout 120 python3 -m pytest -q -x -m 'gpu or not gpu' packages/sparse-kernels/tests/test_summary_codes.py packages/sparse-kernels/tests/test_page_bounds.py packages/sparse-kernels/tests/test_summary_update.py packages/sparse-kernels/tests/test_block_summary.py tests/test_cuda_engine.py -k 'not omnikv' > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 3)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 90 "${B[@]}" --timed-steps 512 --out $OUT/b5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 80 "${B[@]}" "${Q[@]}" --timed-steps 1024 --out $OUT/b5 --append > $OUT/quest_int8.txt 2>&1; tail -1 $OUT/quest_int8.txt
timeout 80 "${B[@]}" "${Q[@]}" --quest-summary-dtype model --timed-steps 1024 --out $OUT/b5 --append > $OUT/quest_model.txt 2>&1; tail -1 $OUT/quest_model.txt
grep "^|" $OUT/b5/bench.md | grep -v -- "---"
python3 - <<PY
import json, statistics as st
d = json.load(open("$OUT/b5/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = [x * 1e3 for x in raw["step_seconds"]]; m = r["metrics"]
        print(r["sparse_method"], inv.get("config", {}).get("quest_summary_dtype"), "steps", len(s), "wall ms/step", round(m["ms_per_step"], 3), "median", round(m["ms_per_step_median"], 3), "tok/s", round(m["tokens_per_s"], 1), "copy", round(m["fraction_of_copy_bw"], 3), "busy", raw.get("gpu_kernel_ms_per_step"), "long", sorted(round(x, 1) for x in s)[-5:])
        for k in raw.get("gpu_kernels_top", [])[:9]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
