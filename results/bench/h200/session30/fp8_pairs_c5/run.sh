#!/usr/bin/env bash
# Session 30, call 5 (issues 14, 17): fp8 values read as 32-bit words of token pairs (fp8_value_pairs: PRMT + cvt in
# PTX, the tile's rows permuted so each MMA lane's rows are its words' channels), whole steps unmasked. GPU tests of
# the quantized decode, the decode with logits and the quantized engine; the kernel probe for fp8 at block 16; the
# engine: dense, fp8_kv at 5 and its largest, Quest-2048 and OmniKV-2048 over fp8 at 5.
# Usage from the repository root (packages importable): bash run.sh OUT COMMIT
set -uo pipefail
OUT=$1; C=${2:-unknown}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/clocks.txt" 2>&1
PROBE=packages/sparse-kernels/benchmarks/quantized_decode_bandwidth.py
timeout 170 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_quantized_decode.py \
  packages/sparse-kernels/tests/test_decode_logits.py "tests/test_quantized_kv_engine.py::test_cuda_graphs_and_pipelining_equal_eager_and_track_the_cpu_reference" \
  > "$OUT/gpu_tests.txt" 2>&1; echo "tests rc $?" >> "$OUT/logs/rc.txt"
timeout 80 python3 $PROBE --schemes fp8:8 --batches 5,11 --block-size 16 --budget 20 --jsonl "$OUT/new.jsonl" \
  > "$OUT/logs/probe.txt" 2>&1; echo "probe rc $?" >> "$OUT/logs/rc.txt"
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --timed-steps 64 --profile-steps 3 --out "$OUT/engine")
timeout 100 "${B[@]}" --batch-size 5 > "$OUT/logs/dense.txt" 2>&1; echo "dense rc $?" >> "$OUT/logs/rc.txt"
timeout 130 "${B[@]}" --append --sparse-method fp8_kv --batch-size 5,max > "$OUT/logs/fp8.txt" 2>&1
echo "fp8 rc $?" >> "$OUT/logs/rc.txt"
SEL=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --kv-cache-dtype fp8 --batch-size 5)
for M in quest omnikv; do
  timeout 90 "${B[@]}" --append --sparse-method $M "${SEL[@]}" > "$OUT/logs/$M.txt" 2>&1; echo "$M rc $?" >> "$OUT/logs/rc.txt"
done
python3 results/bench/engine_summary.py "$OUT/engine/bench.json" --kernels 4 > "$OUT/summary.txt" 2>&1
cat "$OUT/logs/rc.txt"
