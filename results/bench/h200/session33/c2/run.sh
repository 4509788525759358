#!/usr/bin/env bash
# Session 31 call 2 (issue 17): the GPU tests of what changed (coded ranking logits, heads-together page bounds,
# the one-launch picks, RetroInfer under CUDA graphs), then RetroInfer's quality with model-dtype centroids (the
# default) and with int8 centroid codes, paired with dense in one process (embedded model, 4096-token prompts,
# index forced from 1024 tokens, 8 samples per task and depth). Not run in session 31 (no device); from the repository root: bash run.sh OUT COMMIT
set -x
OUT=$1; C=$2
mkdir -p $OUT
echo "$C" > $OUT/commit.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_logits.py packages/sparse-kernels/tests/test_page_bounds.py packages/sparse-kernels/tests/test_summary_codes.py packages/sparse-kernels/tests/test_cluster_kernels_compile.py "packages/sparse-methods/tests/test_cluster_selection.py::test_cuda_half_precision_ranking_equals_the_reference" "packages/sparse-methods/tests/test_cluster_selection.py::test_triton_picks_equal_the_full_sort_reference" tests/test_retroinfer_engine.py::test_decode_replays_cuda_graphs_and_equals_eager > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
(cd scripts && timeout 400 python3 eval_kv_dtypes.py --set retroinfer --chunk 2048 --device cuda --samples-per-cell 8 --stores dense,retroinfer-0.018+0.232,retroinfer-0.018+0.232-int8 --out $OUT/quality > $OUT/quality_log.txt 2>&1)
tail -6 $OUT/quality_log.txt
