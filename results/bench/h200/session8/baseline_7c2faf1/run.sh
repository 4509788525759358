#!/usr/bin/env bash
# Session 8 baseline at 7c2faf1 (one H200, Qwen3-8B shape, dummy bf16, synthetic prefill, block 16,
# chunk 2048, CUDA graphs). Usage: bash run.sh OUT COMMIT, from a tree with the packages importable.
set -x
OUT=$1; COMMIT=$2
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT" --prompt-len 131072 --output-len 2048)
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
Q=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
"${B[@]}" --out $OUT/qa --batch-size max --timed-steps 48 --profile-steps 3 --max-num-seqs 8
for M in quest omnikv; do
  "${B[@]}" --out $OUT/qa --append --sparse-method $M "${Q[@]}" --batch-size 5 --timed-steps 48 --profile-steps 3 --max-num-seqs 8
done
"${B[@]}" --out $OUT/ev --batch-size max --timed-steps 48 --profile-steps 3 --max-num-seqs 8
"${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --batch-size 5,max --timed-steps 128 --profile-steps 3 --max-num-seqs 192
for M in pyramidkv adakv; do
  "${B[@]}" --out $OUT/ev --append --sparse-method $M "${S[@]}" --batch-size max --timed-steps 16 --max-num-seqs 192
done
