#!/usr/bin/env bash
# Session 24 call 3: which GPU test failed in call 2 (its log was cut by the timeout), then RetroInfer against dense
# at 128K x 5 with cluster_select's self-zeroing state (no memset launch; histograms zeroed by the write pass).
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 260 python3 -m pytest -q -rf -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_select.py \
  tests/test_cuda_engine.py packages/sparse-kernels/tests/test_triton_decode.py packages/sparse-kernels/tests/test_paged_decode.py \
  packages/sparse-kernels/tests/test_decode_lse.py packages/sparse-kernels/tests/test_decode_logits.py > $OUT/gpu_tests.txt 2>&1
grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt | tail -8
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 256 --out $OUT/engine)
timeout 80 "${B[@]}" > $OUT/dense.txt 2>&1
timeout 120 "${B[@]}" --append --sparse-method retroinfer --timed-steps 1100 > $OUT/retro.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 14 > $OUT/summary.txt; cat $OUT/summary.txt
(cd $OUT && tar czf engine.tgz engine dense.txt retro.txt && rm -rf engine dense.txt retro.txt)
