#!/usr/bin/env bash
# Session 15 call 5: issue 17's numbers over the whole 2K decode at batch 5 / 128K, side by side in one run:
# dense, Quest-2048 (int8 page summaries, the default), OmniKV-2048.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 3 --timed-steps 2040)
timeout 150 "${B[@]}" --out $OUT/b5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 90 "${B[@]}" --sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --out $OUT/b5 --append > $OUT/quest.txt 2>&1; tail -1 $OUT/quest.txt
timeout 100 "${B[@]}" --sparse-method omnikv --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --out $OUT/b5 --append > $OUT/omnikv.txt 2>&1; tail -1 $OUT/omnikv.txt
grep "^|" $OUT/b5/bench.md | grep -v -- "---"
python3 - <<PY
import json, statistics as st
d = json.load(open("$OUT/b5/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = [x * 1e3 for x in raw["step_seconds"]]; m = r["metrics"]
        print(r["sparse_method"], "steps", len(s), "wall ms/step", round(m["ms_per_step"], 3), "median", round(m["ms_per_step_median"], 3), "tok/s", round(m["tokens_per_s"], 1), "copy", round(m["fraction_of_copy_bw"], 3), "busy", raw.get("gpu_kernel_ms_per_step"), "long", sorted(round(x, 1) for x in s)[-6:])
        for k in raw.get("gpu_kernels_top", [])[:6]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
