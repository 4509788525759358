#!/usr/bin/env bash
# Session 12 call 3: kernel probe sweep (order tilings, estimation precision / stages), RetroInfer with the Triton and the torch ranking order next to dense.
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 150 python3 benchmarks/retroinfer_kernel_probe.py > $OUT/probe.txt 2>&1; cat $OUT/probe.txt | tail -70
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8)
timeout 45 "${B[@]}" --out $OUT/b5 --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/dense_log.txt 2>&1; tail -1 $OUT/dense_log.txt
timeout 90 "${B[@]}" --out $OUT/b5 --append --sparse-method retroinfer --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/retro_log.txt 2>&1; tail -3 $OUT/retro_log.txt | cut -c1-300
timeout 90 python3 torch_order.py bench --no-progress --commit "$C-torch-order" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --out $OUT/b5t --sparse-method retroinfer --batch-size 5 --timed-steps 64 > $OUT/retro_torch_log.txt 2>&1; tail -3 $OUT/retro_torch_log.txt | cut -c1-300
grep "^|" $OUT/b5/bench.md | head -6
python3 - <<PY
import json, statistics
d = json.load(open("$OUT/b5/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]; med = statistics.median(s)
        print(r["sparse_method"], raw["batch_size"], "steps", len(s), "median", round(med * 1e3, 2), "mean", round(sum(s) / len(s) * 1e3, 2), "busy", raw.get("gpu_kernel_ms_per_step"))
        for k in raw.get("gpu_kernels_top", [])[:30]:
            print("   ", k["name"][:70], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
