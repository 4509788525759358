#!/usr/bin/env bash
# Session 22 call 3: the KV store that also updates Quest's page summaries (one launch), on top of PDL for the
# selection kernels and RetroInfer's graphed index update: native GPU tests (query-aware engine on CUDA against
# CPU, graph replays, the kernels), then dense, Quest-2048, OmniKV-2048 (256 steps) and RetroInfer (1100 steps)
# side by side at 128K x 5.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_index_graphs.py \
  packages/sparse-kernels/tests/test_store_summary.py packages/sparse-kernels/tests/test_decode_logits.py \
  packages/sparse-kernels/tests/test_gpu_kernels.py tests/test_retroinfer_engine.py \
  tests/test_cuda_engine.py -k "not fp32 and not staggered and not eviction and not mostly" > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
COMMIT=$C timeout 200 bash results/bench/run_h200_query_aware.sh $OUT/engine "quest omnikv" > $OUT/qa.txt 2>&1
timeout 110 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 \
  --batch-size 5 --profile-steps 3 --out $OUT/engine --append --sparse-method retroinfer --timed-steps 1100 --max-num-seqs 8 > $OUT/retro.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 13
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
