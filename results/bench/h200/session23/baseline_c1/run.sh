#!/usr/bin/env bash
# Session 23 call 1: GPU tests of the decode-reduce merge (c150676) and friends, then dense, Quest-2048, OmniKV-2048,
# SnapKV-8192 (256 steps) and RetroInfer (1100 steps) side by side at 128K x 5; RetroInfer's update cost probe.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_decode_merge_with.py \
  packages/sparse-kernels/tests/test_cluster_estimation.py packages/sparse-kernels/tests/test_store_summary.py \
  tests/test_retroinfer_engine.py -k "not test_triton_equals_reference and not test_triton_picks_equal" > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
COMMIT=$C timeout 200 bash results/bench/run_h200_query_aware.sh $OUT/engine "quest omnikv" > $OUT/qa.txt 2>&1
timeout 60 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 \
  --batch-size 5 --profile-steps 3 --out $OUT/engine --append --sparse-method snapkv --timed-steps 256 --max-num-seqs 8 \
  --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 > $OUT/snapkv.txt 2>&1
timeout 110 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 \
  --batch-size 5 --profile-steps 3 --out $OUT/engine --append --sparse-method retroinfer --timed-steps 1100 --max-num-seqs 8 > $OUT/retro.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 16
timeout 60 python3 benchmarks/retroinfer_update_cost.py --device cuda --requests 5 > $OUT/update_r5.txt 2>&1; tail -5 $OUT/update_r5.txt
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
