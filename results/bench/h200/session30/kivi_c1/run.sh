#!/usr/bin/env bash
# Session 30, call 1: KIVI's decode with grouped values (scales folded into the probabilities, token pairs in one
# register) and codes by mask + exact FMA, against the committed kernel (a checkout of BASE in ./base), on one H200.
# Usage from the repository root (packages importable): bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1; COMMIT=${2:-unknown}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/clocks.txt" 2>&1
echo "commit $COMMIT" > "$OUT/log.txt"
PROBE=packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py
timeout 170 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_quantized_decode.py \
  > "$OUT/gpu_tests.txt" 2>&1; echo "gpu tests rc $?" >> "$OUT/log.txt"
BASE=${BASE:-base}
if [ -d "$BASE" ]; then
  (cd "$BASE" && PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') timeout 120 python3 $PROBE --schemes kivi:4,kivi:2 \
    --batches 5,16 --budget 0 --jsonl "$OUT/base.jsonl" > "$OUT/base.txt" 2>&1); echo "base rc $?" >> "$OUT/log.txt"
fi
timeout 300 python3 $PROBE --schemes bf16:16,kivi:4,kivi:2 --batches 5,16 --budget 200 --jsonl "$OUT/new.jsonl" \
  > "$OUT/new.txt" 2>&1; echo "new rc $?" >> "$OUT/log.txt"
