#!/usr/bin/env bash
# Session 22 call 4: the GPU tests call 3's 150 s limit cut short, most important first (query-aware engine on CUDA
# against CPU and under CUDA graphs, RetroInfer's engine tests, the fused store + summary kernel).
OUT=$1
mkdir -p $OUT
timeout 170 python3 -m pytest -v -p no:cacheprovider tests/test_cuda_engine.py::test_query_aware_methods_on_cuda_equal_cpu \
  tests/test_cuda_engine.py::test_selecting_decode_steps_replay_cuda_graphs tests/test_retroinfer_engine.py \
  packages/sparse-kernels/tests/test_store_summary.py packages/sparse-kernels/tests/test_cluster_index_graphs.py > $OUT/gpu_tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | tail -40
