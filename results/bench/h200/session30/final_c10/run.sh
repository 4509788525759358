#!/usr/bin/env bash
# Session 30, call 10 (issue 14): the committed head, dense and fp8_kv side by side in one call (fp8 at dense's batch
# and at its own largest), 128 timed steps. Usage from the repository root (packages importable): bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1; C=${2:-unknown}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/clocks.txt" 2>&1
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --timed-steps 128 --out "$OUT/engine")
timeout 100 "${B[@]}" --batch-size max > "$OUT/logs/dense.txt" 2>&1; echo "dense rc $?" >> "$OUT/logs/rc.txt"
timeout 120 "${B[@]}" --append --sparse-method fp8_kv --batch-size 5,max > "$OUT/logs/fp8.txt" 2>&1
echo "fp8 rc $?" >> "$OUT/logs/rc.txt"
cat "$OUT/logs/rc.txt"
