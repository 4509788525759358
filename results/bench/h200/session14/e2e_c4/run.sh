#!/usr/bin/env bash
# Session 14 call 4 (issue 16's end-to-end mode, first run on the H200): 4 requests of 128K in / 2K out arriving at
# once, wall time to the last token with prefill, dense then SnapKV-8192; then dense and SnapKV at batch 5 with the
# new split target (issue 15's ratio over the whole 2K decode).
set -x
OUT=$1; C=$2
mkdir -p $OUT
E=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --e2e 4 --prompt-len 131072 --output-len 2048 --max-num-seqs 8)
timeout 200 "${E[@]}" --out $OUT/e2e > $OUT/e2e_dense.txt 2>&1; tail -4 $OUT/e2e_dense.txt
timeout 170 "${E[@]}" --out $OUT/e2e --append --sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 > $OUT/e2e_snapkv.txt 2>&1; tail -4 $OUT/e2e_snapkv.txt
grep "^|" $OUT/e2e/bench.md | grep -v -- "---"; grep -i "vs dense\|\*\*" $OUT/e2e/bench.md | head -5
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 3)
timeout 75 "${B[@]}" --sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 --timed-steps 2040 --out $OUT/b5 > $OUT/snap_b5.txt 2>&1; tail -1 $OUT/snap_b5.txt
timeout 110 "${B[@]}" --timed-steps 2040 --out $OUT/b5 --append > $OUT/dense_b5.txt 2>&1; tail -1 $OUT/dense_b5.txt
grep "^|" $OUT/b5/bench.md | grep -v -- "---"; grep "\*\*" $OUT/b5/bench.md | head -4
