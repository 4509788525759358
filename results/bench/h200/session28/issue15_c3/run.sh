#!/usr/bin/env bash
# Session 28 call 3 (issue 15, re-measured at this commit): 128K in / 2K planned, Qwen3-8B shape, synthetic prefill,
# budget 8192 (64 + 7616 + 512): dense b5 whole 2K; SnapKV-8192 every 512 at b5 whole 2K; SnapKV every 256 at its
# largest batch whole 2K (GPU busy from 3 profiled steps); PyramidKV / AdaKV / SnapKV without decode-time eviction at
# their largest batches (32 steps: what fits); KVzip's prefill at 32K against dense (real prefill, chunk 4096).
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048)
timeout 105 "${B[@]}" --out $OUT/ev --batch-size 5 --timed-steps 2040 --profile-steps 3 --max-num-seqs 8 > $OUT/logs/dense.txt 2>&1
timeout 65 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --decode-eviction-interval 512 --batch-size 5 --timed-steps 2040 --profile-steps 3 --max-num-seqs 8 > $OUT/logs/snap512.txt 2>&1
timeout 160 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --decode-eviction-interval 256 --batch-size max --timed-steps 2040 --profile-steps 3 --max-num-seqs 192 > $OUT/logs/snapmax.txt 2>&1
grep "^| \(dense\|snapkv\)" $OUT/ev/bench.md | cut -c1-260; grep "\*\*" $OUT/ev/bench.md
for m in snapkv pyramidkv adakv; do
  timeout 50 "${B[@]}" --out $OUT/fit --append --sparse-method $m "${S[@]}" --decode-eviction-interval 0 --batch-size max --timed-steps 32 --max-num-seqs 192 > $OUT/logs/fit_$m.txt 2>&1
done
grep "^| \(snapkv\|pyramidkv\|adakv\)" $OUT/fit/bench.md | cut -c1-200
K=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 32768 --output-len 16 --batch-size 1 --prefill real --max-num-batched-tokens 4096 --max-num-seqs 8 --out $OUT/kvzip)
timeout 50 "${K[@]}" --sparse-method dense > $OUT/logs/kvzip_dense.txt 2>&1
timeout 60 "${K[@]}" --append --tokenizer packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval --sparse-method kvzip > $OUT/logs/kvzip.txt 2>&1
grep -A5 "^## Prefill" $OUT/kvzip/bench.md | grep "^| \(dense\|kvzip\)" | cut -c1-200
python3 results/bench/engine_summary.py $OUT/ev/bench.json --kernels 4 > $OUT/summary.txt 2>&1; cut -c1-260 $OUT/summary.txt
(cd $OUT && tar czf all.tgz ev fit kvzip logs && rm -rf ev fit kvzip logs)
