#!/usr/bin/env bash
# Session 24 call 4: the closing numbers at HEAD, side by side at 128K x 5 (dense's largest batch): dense and
# SnapKV-8192 over the whole 2K decode; dense, Quest-2048 and OmniKV-2048 over 256 steps.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8
  --batch-size 5 --profile-steps 3)
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
QA=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 110 "${B[@]}" --timed-steps 2040 --out $OUT/whole > $OUT/logs/dense_whole.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 2040 --out $OUT/whole --append "${SNAP[@]}" > $OUT/logs/snap_whole.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 256 --out $OUT/engine > $OUT/logs/dense.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 256 --out $OUT/engine --append --sparse-method quest "${QA[@]}" > $OUT/logs/quest.txt 2>&1
timeout 60 "${B[@]}" --timed-steps 256 --out $OUT/engine --append --sparse-method omnikv "${QA[@]}" > $OUT/logs/omnikv.txt 2>&1
(python3 results/bench/engine_summary.py $OUT/whole/bench.json --kernels 6
 python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 8) > $OUT/summary.txt 2>&1; cat $OUT/summary.txt
grep -h "^| \(dense\|snapkv\|quest\|omnikv\)" $OUT/whole/bench.md $OUT/engine/bench.md
(cd $OUT && tar czf engine.tgz engine whole logs && rm -rf engine whole logs)
