#!/usr/bin/env bash
# Session 29 call 1 (issue 17): RetroInfer's cluster selection in one launch. GPU tests of the cluster kernels and
# RetroInfer's engine (graphs), then dense and RetroInfer (defaults) at batch 5, 128K, 256 timed steps, profiled.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 200 python3 -m pytest -q -x -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_select.py \
  packages/sparse-kernels/tests/test_cluster_kernels_compile.py packages/sparse-methods/tests/test_cluster_selection.py \
  tests/test_retroinfer_engine.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
COMMIT=$C timeout 300 bash results/bench/run_h200_query_aware.sh $OUT/qa "retroinfer" > $OUT/log.txt 2>&1
tail -40 $OUT/log.txt
