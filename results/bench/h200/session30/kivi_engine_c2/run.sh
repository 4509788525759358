#!/usr/bin/env bash
# Session 30, call 2 (issue 14): the engine's KIVI-4 / KIVI-2 decode with the grouped values (6920a4a) next to dense
# in one process family on one H200: Qwen3-8B shape, dummy bf16 weights, 128K prompt, memory planned for 2048 output
# tokens, synthetic prefill, dense at its largest batch, each KIVI store at dense's batch and at its own largest.
# Usage from the repository root (packages importable): bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1; C=${2:-unknown}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/clocks.txt" 2>&1
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --timed-steps 64 --profile-steps 3 --out "$OUT/engine")
timeout 130 "${B[@]}" --batch-size max > "$OUT/logs/dense.txt" 2>&1; echo "dense rc $?" >> "$OUT/logs/rc.txt"
DENSE=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['invocations'][0]['runs'][0]['batch_size'])" \
  "$OUT/engine/bench.json" 2>/dev/null || echo 5)
for BITS in 4 2; do
  timeout 190 "${B[@]}" --append --sparse-method kivi --kivi-bits $BITS --batch-size "$DENSE,max" \
    > "$OUT/logs/kivi$BITS.txt" 2>&1; echo "kivi$BITS rc $?" >> "$OUT/logs/rc.txt"
done
python3 results/bench/engine_summary.py "$OUT/engine/bench.json" --kernels 4 > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"; cat "$OUT/logs/rc.txt"
