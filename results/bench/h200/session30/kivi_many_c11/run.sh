#!/usr/bin/env bash
# Session 30, call 11 (issue 14): KIVI-4 / KIVI-2 in the probe at the engine's largest batches (18, 31: more lists
# than SMs, where the split aims at PROGRAMS_PER_SM_MANY_LISTS programs a SM), sweeping that target ("many") first.
# Usage from the repository root (packages importable): bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1
mkdir -p "$OUT"
timeout 130 python3 packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py --schemes kivi:4,kivi:2 \
  --batches 18,31 --budget 75 --jsonl "$OUT/many.jsonl" > "$OUT/many.txt" 2>&1
