#!/usr/bin/env bash
# Session 9 call 2: small-M linear kernel at 80/96 rows vs cuBLAS; Quest/OmniKV at dense's batch after the top-k change.
set -x
OUT=$1; C=$2
mkdir -p $OUT
PYTHONPATH=$PYTHONPATH:packages/sparse-kernels/benchmarks timeout 330 python3 packages/sparse-kernels/benchmarks/small_m_linear.py --rows 80,96 --json $OUT/mid_m.json > $OUT/mid_m.txt 2>&1
grep -A200 "^shape" $OUT/mid_m.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048)
Q=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 90 "${B[@]}" --out $OUT/qa --batch-size 5 --timed-steps 128 --profile-steps 3 --max-num-seqs 8 > $OUT/qa_log.txt 2>&1
for M in quest omnikv; do
timeout 90 "${B[@]}" --out $OUT/qa --append --sparse-method $M "${Q[@]}" --batch-size 5 --timed-steps 128 --profile-steps 3 --max-num-seqs 8 >> $OUT/qa_log.txt 2>&1
done
tail -n 6 $OUT/qa/bench.md
python3 - <<PY
import json
d=json.load(open("$OUT/qa/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw=r["raw"]; print(r["sparse_method"], raw.get("gpu_kernel_ms_per_step"), [(k["name"][:40], round(k["ms_per_step"],3), k["calls_per_step"]) for k in raw.get("gpu_kernels_top", [])])
PY
