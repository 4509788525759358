#!/usr/bin/env bash
# Session 15 call 2: page-bound variants (bf16 / int8 / fp8 summaries; bf16 / fp16 dots or FMA), the GPU MLA
# Quest test with int8 codes, and Quest-2048 at batch 5 with the bench's per-step slot count sampled (how much of
# its wall time per step is the bench's own bookkeeping), against the plain bench, same commit.
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 150 python3 pb_variants.py > $OUT/pbv.txt 2>&1; grep -v -i warn $OUT/pbv.txt
timeout 60 python3 -m pytest -q -x -m 'gpu or not gpu' tests/test_mla_quest.py packages/sparse-kernels/tests/test_summary_codes.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt; grep -m3 -B12 "^E " $OUT/gpu_tests.txt | head -40
B=(bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 0)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --quest-summary-dtype model)
timeout 70 python3 lightbench.py "${B[@]}" "${Q[@]}" --timed-steps 384 --out $OUT/b5 > $OUT/quest_light.txt 2>&1; tail -1 $OUT/quest_light.txt
timeout 70 python3 -m sparse_serve.cli "${B[@]}" "${Q[@]}" --timed-steps 384 --out $OUT/b5 --append > $OUT/quest_plain.txt 2>&1; tail -1 $OUT/quest_plain.txt
python3 - <<PY
import json, statistics as st
d = json.load(open("$OUT/b5/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = [x * 1e3 for x in raw["step_seconds"]]; m = r["metrics"]
        print(r["sparse_method"], "steps", len(s), "wall ms/step", round(m["ms_per_step"], 3), "sum(step)/n", round(st.mean(s), 3), "median", round(m["ms_per_step_median"], 3), "tok/s", round(m["tokens_per_s"], 1), "long", sorted(round(x, 1) for x in s)[-5:])
PY
