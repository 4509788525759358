#!/usr/bin/env bash
# Session 23 call 3: the fused epilogues with their residual / norm weight loads issued before the weight stream:
# native GPU tests, per-projection epilogue cost (linear_epilogue_probe), then the engine at 128K x 5, fused:
# dense and SnapKV-8192 over the whole 2K decode (2040 steps), dense, Quest-2048 and OmniKV-2048 (256 steps),
# RetroInfer (1100 steps).
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_linear_epilogue.py \
  packages/sparse-kernels/tests/test_linear.py tests/test_cuda_engine.py -k "epilogue or linear or fused or bf16" > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
export PYTHONPATH=$PYTHONPATH:$PWD/packages/sparse-kernels/benchmarks
timeout 90 python3 packages/sparse-kernels/benchmarks/linear_epilogue_probe.py --rows 1,5 --json $OUT/epilogue.json > $OUT/epilogue.txt 2>&1; cat $OUT/epilogue.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
QA=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 110 "${B[@]}" --timed-steps 2040 --out $OUT/whole > $OUT/dense_whole.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 2040 --out $OUT/whole --append "${SNAP[@]}" > $OUT/snap_whole.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 256 --out $OUT/engine > $OUT/dense.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 256 --out $OUT/engine --append --sparse-method quest "${QA[@]}" > $OUT/quest.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 256 --out $OUT/engine --append --sparse-method omnikv "${QA[@]}" > $OUT/omnikv.txt 2>&1
timeout 90 "${B[@]}" --timed-steps 1100 --out $OUT/engine --append --sparse-method retroinfer > $OUT/retro.txt 2>&1
python3 results/bench/engine_summary.py $OUT/whole/bench.json --kernels 6
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 8
(cd $OUT && tar czf engine.tgz engine whole && rm -rf engine whole && rm -f *.txt.keep)
