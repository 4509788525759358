#!/usr/bin/env bash
# Session 29 call 2 (issue 17): the one-program cluster selection, probed alone against the three-launch one (warps
# 4-32), GPU tests of the cluster kernels, then RetroInfer at batch 5 / 128K (256 timed steps, profiled) beside dense.
# Ran at a4c4c9d, whose tree also held old_cluster_select.py (the three-launch kernel of 1bc70f8~1, which the
# package holds again since the revert): check that commit out to re-run it.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
D=results/bench/h200/session29/select_c2
timeout 120 python3 $D/select_probe.py $D/old_cluster_select.py $OUT/select_probe.json 2>&1 | tail -8
timeout 150 python3 -m pytest -q -x -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_select.py \
  packages/sparse-kernels/tests/test_cluster_kernels_compile.py packages/sparse-methods/tests/test_cluster_selection.py \
  tests/test_retroinfer_engine.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
COMMIT=$C timeout 240 bash results/bench/run_h200_query_aware.sh $OUT/qa "retroinfer" > $OUT/log.txt 2>&1
grep -A12 "^retroinfer ms" $OUT/log.txt; grep "^| \(dense\|retro\)" $OUT/qa/bench.md | cut -c1-200
