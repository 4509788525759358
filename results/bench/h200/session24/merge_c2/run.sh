#!/usr/bin/env bash
# Session 24 call 2: the split-K decode merging its own partials (no reduce launch). GPU tests; the whole-step
# probe (b5, 8K and 128K, fused, merge vs reduce launch); the engine at 128K x 5: dense and SnapKV-8192 with the
# reduce launch (MERGE_MAX_SPLITS=0) and merged, Quest-2048 / OmniKV-2048 / RetroInfer merged; fp8_kv at its
# largest batch with a kernel profile (issue 14: why 47 ms a step where the bytes say ~30).
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_decode_merge_in_kernel.py \
  packages/sparse-kernels/tests/test_triton_decode.py packages/sparse-kernels/tests/test_paged_decode.py \
  packages/sparse-kernels/tests/test_decode_lse.py packages/sparse-kernels/tests/test_decode_logits.py \
  packages/sparse-kernels/tests/test_cluster_select.py tests/test_cuda_engine.py > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
export PYTHONPATH=$PYTHONPATH:$PWD/packages/sparse-kernels/benchmarks
timeout 150 python3 packages/sparse-kernels/benchmarks/decode_step_probe.py --batch 5 --kv-len 8192,131072 --per-sm 4 \
  --fused --reduce-ab --no-pdl-off --json $OUT/probe.json > $OUT/probe.txt 2>&1; cat $OUT/probe.txt
B=(python3 mergewrap.py bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 256 --out $OUT/engine)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
QA=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
MERGE_MAX_SPLITS=0 timeout 80 "${B[@]}" --commit "$C+reduce-launch" > $OUT/dense_reduce.txt 2>&1
MERGE_MAX_SPLITS=0 timeout 60 "${B[@]}" --append --commit "$C+reduce-launch" "${SNAP[@]}" > $OUT/snap_reduce.txt 2>&1
timeout 80 "${B[@]}" --append > $OUT/dense.txt 2>&1
timeout 60 "${B[@]}" --append "${SNAP[@]}" > $OUT/snap.txt 2>&1
timeout 60 "${B[@]}" --append --sparse-method quest "${QA[@]}" > $OUT/quest.txt 2>&1
timeout 60 "${B[@]}" --append --sparse-method omnikv "${QA[@]}" > $OUT/omnikv.txt 2>&1
timeout 110 "${B[@]}" --append --sparse-method retroinfer --timed-steps 1100 > $OUT/retro.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 10
timeout 90 python3 mergewrap.py bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64 \
  --sparse-method fp8_kv --batch-size max --profile-steps 3 --timed-steps 32 --out $OUT/fp8 > $OUT/fp8.txt 2>&1
python3 results/bench/engine_summary.py $OUT/fp8/bench.json --kernels 12
(cd $OUT && tar czf engine.tgz engine fp8 && rm -rf engine fp8)
