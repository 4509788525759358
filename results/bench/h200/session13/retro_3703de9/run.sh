#!/usr/bin/env bash
# Session 13 call 4: RetroInfer with the count selection (cluster_select) at batch 5 / 128K next to dense; GPU tests; quality.
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 80 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_select.py packages/sparse-methods/tests/test_cluster_selection.py packages/sparse-kernels/tests/test_cluster_logits.py -k "logits or cuda" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt | cut -c1-300
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8)
timeout 45 "${B[@]}" --out $OUT/b5 --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/dense_log.txt 2>&1; tail -1 $OUT/dense_log.txt
timeout 90 "${B[@]}" --out $OUT/b5 --append --sparse-method retroinfer --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/retro_log.txt 2>&1; tail -3 $OUT/retro_log.txt | cut -c1-300
grep "^|" $OUT/b5/bench.md | head -6
python3 - <<PY
import json, statistics
d = json.load(open("$OUT/b5/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]; med = statistics.median(s)
        print(r["sparse_method"], raw["batch_size"], "steps", len(s), "median", round(med * 1e3, 2), "mean", round(sum(s) / len(s) * 1e3, 2), "wall", raw["wall_seconds"], "busy", raw.get("gpu_kernel_ms_per_step"))
        for k in raw.get("gpu_kernels_top", [])[:24]:
            print("   ", k["name"][:70], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
timeout 170 python3 scripts/eval_kv_dtypes.py --set retroinfer --chunk 2048 --device cuda --samples-per-cell 8 --stores dense,retroinfer-0.018+0.232 --out $OUT/quality > $OUT/quality_log.txt 2>&1; tail -8 $OUT/quality_log.txt | cut -c1-400; ls $OUT/quality
