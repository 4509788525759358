#!/usr/bin/env bash
# Session 29 call 6 (issue 17): the cluster selection's first round into one histogram for both targets. GPU tests of
# the cluster kernels; the selection alone against the kernel before (before_cluster_select.py, from d5bcafe: copy it
# beside this script first); dense and RetroInfer at batch 5 / 128K, 256 timed steps, profiled.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
D=results/bench/h200/session29/final_c6
timeout 60 python3 $D/select_probe.py $D/before_cluster_select.py $OUT/select_probe.json 2>&1 | tail -4
timeout 100 python3 -m pytest -q -x -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_select.py \
  packages/sparse-methods/tests/test_cluster_selection.py -k "not test_triton_equals_reference" > $OUT/gpu_tests.txt 2>&1
tail -1 $OUT/gpu_tests.txt
COMMIT=$C timeout 200 bash results/bench/run_h200_query_aware.sh $OUT/qa "retroinfer" > $OUT/log.txt 2>&1
grep "^| \(dense\|retro\)" $OUT/qa/bench.md | cut -c1-200; grep -A11 "^retroinfer ms" $OUT/log.txt
