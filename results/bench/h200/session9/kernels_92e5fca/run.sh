#!/usr/bin/env bash
# Session 9 call 3a: CUDA kernel tests (store copy, window_probs, fused split reduce), the two kernel probes,
# KVzip's 32K prefill after the head-major host work (dense beside it), PyramidKV / AdaKV largest batches.
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 240 python3 -m pytest -q -p no:cacheprovider -m 'gpu or not gpu' packages/sparse-kernels/tests/test_kv_store.py packages/sparse-kernels/tests/test_window_scores.py packages/sparse-kernels/tests/test_decode_fused_reduce.py packages/sparse-kernels/tests/test_triton_decode.py packages/sparse-kernels/tests/test_cuda_graph.py packages/sparse-kernels/tests/test_gpu_kernels.py > $OUT/cuda_kernel_tests.txt 2>&1; tail -3 $OUT/cuda_kernel_tests.txt
timeout 80 python3 benchmarks/window_scores_probe.py --json $OUT/window_scores.json > $OUT/window_probe.txt 2>&1; tail -25 $OUT/window_probe.txt
D=packages/sparse-kernels/benchmarks/decode_bandwidth.py
export PYTHONPATH=$PYTHONPATH:packages/sparse-kernels/benchmarks
timeout 70 python3 $D --kv-len 8192 --cases 5x16,91x1 --reduce-compare > $OUT/fused_reduce.txt 2>&1
timeout 70 python3 $D --kv-len 131072 --cases 5x1 --reduce-compare >> $OUT/fused_reduce.txt 2>&1
timeout 70 python3 $D --kv-len 32768 --cases 1x8 --reduce-compare >> $OUT/fused_reduce.txt 2>&1; grep -v "^\s*$" $OUT/fused_reduce.txt | tail -30
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C")
K=(--prefill real --prompt-len 32768 --output-len 16 --batch-size 1 --max-num-batched-tokens 4096 --max-num-seqs 4)
timeout 60 "${B[@]}" --out $OUT/kvzip "${K[@]}" > $OUT/kvzip_log.txt 2>&1
timeout 120 "${B[@]}" --out $OUT/kvzip --append "${K[@]}" --sparse-method kvzip --tokenizer packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval >> $OUT/kvzip_log.txt 2>&1
grep "^|" $OUT/kvzip/bench.md
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
L=(--prompt-len 131072 --output-len 2048)
for M in snapkv pyramidkv adakv; do
timeout 100 "${B[@]}" --out $OUT/fit --append "${L[@]}" --sparse-method $M "${S[@]}" --batch-size max --timed-steps 32 --max-num-seqs 192 >> $OUT/fit_log.txt 2>&1
done
grep "^|" $OUT/fit/bench.md
