#!/usr/bin/env bash
# Session 23 call 2: the projections' fused epilogues (residual add, RMSNorm, SiLU*mul; linear_epilogue):
# GPU tests, the whole-step probe fused vs unfused (b5, 8K and 128K), then the engine at 128K x 5:
# dense and SnapKV-8192 unfused (SPARSE_KERNELS_FUSED_EPILOGUES=0) and fused, Quest-2048, OmniKV-2048 and
# RetroInfer (1100 steps) fused.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_linear_epilogue.py \
  packages/sparse-kernels/tests/test_linear.py tests/test_cuda_engine.py -k "fused or bf16 or graphs_equal" > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
export PYTHONPATH=$PYTHONPATH:$PWD/packages/sparse-kernels/benchmarks
timeout 150 python3 packages/sparse-kernels/benchmarks/decode_step_probe.py --batch 5 --kv-len 8192,131072 --per-sm 4 \
  --fused --no-pdl-off --json $OUT/probe.json > $OUT/probe.txt 2>&1; cat $OUT/probe.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3 --timed-steps 256 --out $OUT/engine)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
QA=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
SPARSE_KERNELS_FUSED_EPILOGUES=0 timeout 80 "${B[@]}" > $OUT/dense_plain.txt 2>&1
SPARSE_KERNELS_FUSED_EPILOGUES=0 timeout 60 "${B[@]}" --append "${SNAP[@]}" > $OUT/snap_plain.txt 2>&1
timeout 80 "${B[@]}" --append > $OUT/dense.txt 2>&1
timeout 60 "${B[@]}" --append "${SNAP[@]}" > $OUT/snap.txt 2>&1
timeout 60 "${B[@]}" --append --sparse-method quest "${QA[@]}" > $OUT/quest.txt 2>&1
timeout 60 "${B[@]}" --append --sparse-method omnikv "${QA[@]}" > $OUT/omnikv.txt 2>&1
timeout 110 "${B[@]}" --append --sparse-method retroinfer --timed-steps 1100 > $OUT/retro.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 9
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
