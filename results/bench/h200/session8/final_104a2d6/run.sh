#!/usr/bin/env bash
# Session 8 final: issue 15's decode numbers, KVzip's prefill cost, the top-k variants, CUDA tests.
set -x
OUT=$1; COMMIT=$2
mkdir -p $OUT
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT")
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
L=(--prompt-len 131072 --output-len 2048)
"${B[@]}" --out $OUT/ev "${L[@]}" --batch-size max --timed-steps 48 --profile-steps 3 --max-num-seqs 8
"${B[@]}" --out $OUT/ev --append "${L[@]}" --sparse-method snapkv "${S[@]}" --batch-size 5 --timed-steps 128 --profile-steps 3 --max-num-seqs 192
"${B[@]}" --out $OUT/ev --append "${L[@]}" --sparse-method snapkv "${S[@]}" --batch-size max --timed-steps 2040 --profile-steps 3 --max-num-seqs 192
for M in pyramidkv adakv; do
  "${B[@]}" --out $OUT/ev --append "${L[@]}" --sparse-method $M "${S[@]}" --batch-size max --timed-steps 128 --profile-steps 3 --max-num-seqs 192
done
K=(--prefill real --prompt-len 32768 --output-len 16 --batch-size 1 --max-num-batched-tokens 4096 --max-num-seqs 4)
"${B[@]}" --out $OUT/kvzip "${K[@]}"
"${B[@]}" --out $OUT/kvzip --append "${K[@]}" --sparse-method kvzip --tokenizer packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval
timeout 90 python3 benchmarks/quest_select_probe.py --top-k-only --batches 5 --top-k-variants "serial (default),serial t1024,packed b2,packed b2 t1024,packed b3 t1024,packed b2 t512,packed b2 t4096 x4 w512" --json $OUT/topk_variants.json > $OUT/topk.txt 2>&1; tail -14 $OUT/topk.txt
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_head_major.py tests/test_batched_eviction.py tests/test_retroinfer_engine.py -k "cuda" > $OUT/cuda_tests.txt 2>&1; tail -3 $OUT/cuda_tests.txt
