#!/usr/bin/env bash
# Session 20 call 4 (848b4a5): the cluster kernels' tests natively on the H200 (from the repository root, packages importable).
OUT=$1; mkdir -p $OUT
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf packages/sparse-kernels/tests/test_cluster_estimation.py packages/sparse-kernels/tests/test_cluster_logits.py \
  packages/sparse-methods/tests/test_cluster_selection.py packages/sparse-kernels/tests/test_cluster_select.py 2>&1 | tee $OUT/gpu_tests.txt | tail -15
