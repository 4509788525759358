#!/usr/bin/env bash
# Session 13 call 1: RetroInfer / Quest / OmniKV at batch 5 next to dense at 641161d. (The call also timed
# benchmarks/cluster_topk_probe.py, removed since: topk_probe.txt.)
set -x
OUT=$1; C=$2
mkdir -p $OUT
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8)
timeout 50 "${B[@]}" --out $OUT/b5 --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/dense_log.txt 2>&1; tail -3 $OUT/dense_log.txt
timeout 100 "${B[@]}" --out $OUT/b5 --append --sparse-method retroinfer --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/retro_log.txt 2>&1; tail -5 $OUT/retro_log.txt | cut -c1-300
timeout 45 "${B[@]}" --out $OUT/b5 --append --sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/quest_log.txt 2>&1; tail -3 $OUT/quest_log.txt
timeout 45 "${B[@]}" --out $OUT/b5 --append --sparse-method omnikv --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/omni_log.txt 2>&1; tail -3 $OUT/omni_log.txt
grep "^|" $OUT/b5/bench.md | head -12
python3 - <<PY
import json, statistics
d = json.load(open("$OUT/b5/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]; med = statistics.median(s)
        print(r["sparse_method"], raw["batch_size"], "steps", len(s), "median", round(med * 1e3, 2), "mean", round(sum(s) / len(s) * 1e3, 2), "busy", raw.get("gpu_kernel_ms_per_step"), {k: v for k, v in raw.items() if "byte" in k or "bw" in k.lower()})
        for k in raw.get("gpu_kernels_top", [])[:24]:
            print("   ", k["name"][:70], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
