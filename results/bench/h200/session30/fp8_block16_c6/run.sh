#!/usr/bin/env bash
# Session 30, call 6 (issue 14): fp8's decode at 16 tokens a step (one page, BLOCK_N_FP8), on top of fp8_pairs_c5.
# GPU tests of the quantized decode; the probe's fp8 sweep at block 16; the engine: dense, then fp8_kv at 5 and its
# largest batch. Usage from the repository root (packages importable): bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1; C=${2:-unknown}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/clocks.txt" 2>&1
PROBE=packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py
timeout 120 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_quantized_decode.py \
  packages/sparse-kernels/tests/test_decode_logits.py -k fp8 > "$OUT/gpu_tests.txt" 2>&1; echo "tests rc $?" >> "$OUT/logs/rc.txt"
timeout 90 python3 $PROBE --schemes fp8:8 --batches 5,11 --block-size 16 --budget 40 --jsonl "$OUT/new.jsonl" \
  > "$OUT/logs/probe.txt" 2>&1; echo "probe rc $?" >> "$OUT/logs/rc.txt"
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --timed-steps 128 --profile-steps 3 --out "$OUT/engine")
timeout 100 "${B[@]}" --batch-size 5 > "$OUT/logs/dense.txt" 2>&1; echo "dense rc $?" >> "$OUT/logs/rc.txt"
timeout 130 "${B[@]}" --append --sparse-method fp8_kv --batch-size 5,max > "$OUT/logs/fp8.txt" 2>&1
echo "fp8 rc $?" >> "$OUT/logs/rc.txt"
python3 results/bench/engine_summary.py "$OUT/engine/bench.json" --kernels 4 > "$OUT/summary.txt" 2>&1
cat "$OUT/logs/rc.txt"
