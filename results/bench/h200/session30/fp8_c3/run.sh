#!/usr/bin/env bash
# Session 30, call 3 (issue 14): the per-token schemes' decode steps take their one or two page ids as scalars
# (step_rows). GPU tests of the quantized decode and prefill; the kernel probe for fp8 at block 16 (the engine's)
# against a checkout of the committed kernel (BASE), then the sweep; the engine's fp8_kv next to dense.
# Usage from the repository root (packages importable): BASE=<checkout> bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1; C=${2:-unknown}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/clocks.txt" 2>&1
PROBE=packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_quantized_decode.py \
  packages/sparse-kernels/tests/test_quantized_prefill.py > "$OUT/gpu_tests.txt" 2>&1; echo "tests rc $?" >> "$OUT/logs/rc.txt"
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') timeout 90 python3 $PROBE --schemes fp8:8 \
    --batches 5,11 --block-size 16 --budget 0 --jsonl "$OUT/base.jsonl" > "$OUT/logs/base.txt" 2>&1)
  echo "base rc $?" >> "$OUT/logs/rc.txt"
fi
timeout 150 python3 $PROBE --schemes fp8:8 --batches 5,11 --block-size 16 --budget 100 --jsonl "$OUT/new.jsonl" \
  > "$OUT/logs/new.txt" 2>&1; echo "new rc $?" >> "$OUT/logs/rc.txt"
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --timed-steps 64 --profile-steps 3 --out "$OUT/engine")
timeout 110 "${B[@]}" --batch-size 5 > "$OUT/logs/dense.txt" 2>&1; echo "dense rc $?" >> "$OUT/logs/rc.txt"
timeout 150 "${B[@]}" --append --sparse-method fp8_kv --batch-size 5,max > "$OUT/logs/fp8.txt" 2>&1
echo "fp8 rc $?" >> "$OUT/logs/rc.txt"
python3 results/bench/engine_summary.py "$OUT/engine/bench.json" --kernels 4 > "$OUT/summary.txt" 2>&1
cat "$OUT/logs/rc.txt"
# The committed kernel's probe (base/) ran in a second call on the same machine with this probe script and the
# checkout's packages first on PYTHONPATH (the old script had no --block-size; logs/base.txt is its failure):
#   PYTHONPATH=$(ls -d $BASE/packages/*/src | tr '\n' ':') python3 $PROBE --schemes fp8:8 --batches 5,11 \
#     --block-size 16 --budget 0 --jsonl base/base.jsonl
# and a third, still on that machine, ran fp8 transposed in the engine (swap_c4/):
#   SPARSE_KERNELS_SWAP_AB=1 python3 -m sparse_serve.cli bench --prompt-len 131072 --output-len 2048 --max-num-seqs 64 \
#     --timed-steps 64 --profile-steps 3 --sparse-method fp8_kv --batch-size 5,max
