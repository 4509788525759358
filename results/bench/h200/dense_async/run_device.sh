#!/bin/bash
# Issue 3's final H200 measurement with pipelined decode (async scheduling), run from a `git archive`
# of the measured commit with the packages on PYTHONPATH (see results/bench/run_h200.sh part 6).
# Sequential, nothing else on the GPU: CUDA tests of what changed, then the dense decode bench with
# async on, then the same with async off; GPU clocks/power/temperature logged every 500 ms meanwhile.
# Usage: COMMIT=<sha> bash results/bench/h200/dense_async/run_device.sh OUT_DIR   (fits in ~230 s)
set -u
OUT=${1:?out dir}
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT"
L=$OUT/log.txt
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi -L >> "$L" 2>&1
echo "start_unix $(date +%s.%N)" >> "$L"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 \
  > "$OUT/clocks.csv" 2>&1 &
SMI=$!
echo "== tests (t=$(el))" >> "$L"
A=tests/test_async_scheduling.py
timeout 75 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_cuda_graph.py \
  tests/test_cuda_engine.py "$A::test_cuda_graphs_pipelined_equal_synchronous" \
  "$A::test_cuda_query_aware_pipelined_equal_cpu" "$A::test_token_feed_equals_its_reference" > "$OUT/tests.txt" 2>&1
echo "tests rc=$? t=$(el)" >> "$L"
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT" --prompt-len 32768,131072
   --batch-size 1,max --output-len 256 --timed-steps 200 --profile-steps 3 --max-num-seqs 32)
echo "== bench async (t=$(el), unix $(date +%s.%N))" >> "$L"
timeout 75 "${B[@]}" --async-scheduling --out "$OUT/dense" >> "$L" 2>&1
echo "async rc=$? t=$(el)" >> "$L"
echo "== bench sync (t=$(el), unix $(date +%s.%N))" >> "$L"
timeout 70 "${B[@]}" --no-async-scheduling --out "$OUT/dense" --append >> "$L" 2>&1
echo "sync rc=$? t=$(el) unix $(date +%s.%N)" >> "$L"
kill "$SMI" 2>/dev/null
rm -f "$OUT"/dense/*.png
echo "done t=$(el)" >> "$L"
