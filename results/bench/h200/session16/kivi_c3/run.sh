#!/usr/bin/env bash
# Session 16, call 3: KIVI / fp8 decode launch variants (kivi_probe.py; kivi_v2.py is the half-word slice
# kernel it also times), then dense + KIVI-4/-2 + fp8_kv engine runs with the probe's pick patched in
# (benchwrap.py). Usage from the repository root, packages importable: bash run.sh OUT COMMIT
# (copy kivi_probe.py, kivi_v2.py and benchwrap.py to the root first; call 2 = the same probe with the
# variant lists of kivi_c2/probe.jsonl, which needed a PAGES switch that was not kept).
set -x
OUT=$1; COMMIT=$2
mkdir -p $OUT
timeout 200 python3 kivi_probe.py $OUT/probe.jsonl > $OUT/probe.log 2>&1
export BEST_JSON=$OUT/best.json
B=(python3 benchwrap.py bench --no-progress --commit $COMMIT --prompt-len 131072 --output-len 2048 --timed-steps 32 --max-num-seqs 64 --out $OUT/engine)
"${B[@]}" --batch-size 5 > $OUT/dense.log 2>&1
"${B[@]}" --append --sparse-method kivi --kivi-bits 4 --batch-size 5,max > $OUT/kivi4.log 2>&1
"${B[@]}" --append --sparse-method kivi --kivi-bits 2 --batch-size 5,max > $OUT/kivi2.log 2>&1
"${B[@]}" --append --sparse-method fp8_kv --batch-size 5,max > $OUT/fp8.log 2>&1
