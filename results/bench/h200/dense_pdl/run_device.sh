#!/bin/bash
# Issue 3's session-4 H200 measurement: small-M linear kernels and programmatic dependent launch (PDL)
# on top of pipelined decode. Run from a `git archive` of the measured commit with the packages on
# PYTHONPATH (see results/bench/run_h200.sh part 7). Sequential, nothing else on the GPU: CUDA tests of
# what changed; the dense decode bench with async scheduling, HF transformers at batch 1 first in the same
# process; the same bench with PDL off (a side-by-side ratio); then with async off. GPU clocks, power
# and temperature are logged every 500 ms meanwhile.
# Usage: COMMIT=<sha> bash results/bench/h200/dense_pdl/run_device.sh OUT_DIR   (fits in ~400 s)
set -u
OUT=${1:?out dir}
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT"
L=$OUT/log.txt
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi -L >> "$L" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 \
  > "$OUT/clocks.csv" 2>&1 &
SMI=$!
echo "== tests (t=$(el))" >> "$L"
A=tests/test_async_scheduling.py
K=packages/sparse-kernels/tests
timeout 150 python3 -m pytest -q -p no:cacheprovider $K/test_linear.py $K/test_cuda_graph.py $K/test_triton_decode.py \
  tests/test_cuda_engine.py "$A::test_cuda_graphs_pipelined_equal_synchronous" \
  "$A::test_cuda_query_aware_pipelined_equal_cpu" "$A::test_token_feed_equals_its_reference" > "$OUT/tests.txt" 2>&1
echo "tests rc=$? t=$(el)" >> "$L"
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT" --prompt-len 32768,131072
   --batch-size 1,max --output-len 256 --timed-steps 200 --profile-steps 3 --max-num-seqs 32)
echo "== bench async + HF (t=$(el))" >> "$L"
timeout 150 "${B[@]}" --async-scheduling --hf-baseline --hf-steps 20 --out "$OUT/dense" >> "$L" 2>&1
echo "async rc=$? t=$(el)" >> "$L"
echo "== bench async, PDL off (t=$(el))" >> "$L"
timeout 90 python3 -c "import sys; from sparse_kernels._triton import launch; launch.PDL = False
from sparse_serve.cli import main; sys.exit(main(sys.argv[1:]))" "${B[@]:3}" --async-scheduling --out "$OUT/dense" \
  --append >> "$L" 2>&1
echo "nopdl rc=$? t=$(el)" >> "$L"
echo "== bench sync (t=$(el))" >> "$L"
timeout 80 "${B[@]}" --no-async-scheduling --out "$OUT/dense" --append >> "$L" 2>&1
echo "sync rc=$? t=$(el)" >> "$L"
kill "$SMI" 2>/dev/null
rm -f "$OUT"/dense/*.png
echo "done t=$(el)" >> "$L"
