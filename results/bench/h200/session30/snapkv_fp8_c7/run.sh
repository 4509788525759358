#!/usr/bin/env bash
# Session 30, call 7 (issue 14): SnapKV-8192 over fp8 against SnapKV-8192 over bf16, each at its largest batch, next
# to dense, with the fp8 decode of 32bac26. Usage from the repository root (packages importable): bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1; C=${2:-unknown}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/clocks.txt" 2>&1
COMMIT=$C timeout 560 bash results/bench/run_h200_kv_dtypes.sh "$OUT/engine" 64 "dense snapkv" > "$OUT/log.txt" 2>&1
echo "rc $?" >> "$OUT/log.txt"
python3 results/bench/engine_summary.py "$OUT/engine/bench.json" --kernels 4 > "$OUT/summary.txt" 2>&1
