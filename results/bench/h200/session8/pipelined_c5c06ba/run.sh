#!/usr/bin/env bash
# Session 8 at c5c06ba: evicting methods' decode steps pipelined, decode-time eviction with the query
# ring, ragged head-major AdaKV. Usage: bash run.sh OUT COMMIT (packages importable).
set -x
OUT=$1; COMMIT=$2
mkdir -p $OUT
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_head_major.py tests/test_eviction_pipeline.py -k "cuda" > $OUT/cuda_tests.txt 2>&1
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT" --prompt-len 131072 --output-len 2048)
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
"${B[@]}" --out $OUT/ev --batch-size max --timed-steps 48 --profile-steps 3 --max-num-seqs 8
"${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --batch-size 5,max --timed-steps 128 --profile-steps 3 --max-num-seqs 192
"${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --decode-eviction-interval 256 --batch-size 5,max --timed-steps 512 --profile-steps 3 --max-num-seqs 192
"${B[@]}" --out $OUT/ev --append --sparse-method pyramidkv "${S[@]}" --batch-size max --timed-steps 128 --profile-steps 3 --max-num-seqs 192
"${B[@]}" --out $OUT/ev --append --sparse-method adakv "${S[@]}" --batch-size max --timed-steps 128 --profile-steps 3 --max-num-seqs 192
PYTHONPATH=$PYTHONPATH:packages/sparse-kernels/benchmarks timeout 120 python3 packages/sparse-kernels/benchmarks/decode_bandwidth.py --kv-len 8192 --cases 5x16,76x1 --per-sm 1,2,4,16 --json $OUT/split_sweep_8k.json > $OUT/split_sweep_8k.txt 2>&1
