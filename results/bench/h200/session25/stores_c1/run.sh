#!/usr/bin/env bash
# Session 25 call 1 (issue 14 + 17 baseline at f1beae9): the quantized stores at dense's largest batch and at their own
# largest, each in its own decode graph (graphs for every batch up to 32 since 8bd98ff), side by side with dense; and
# RetroInfer over the whole 2K decode (two index updates: the first captures the k-means graph, the second replays it).
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 64
  --profile-steps 3 --out $OUT/engine)
timeout 80 "${B[@]}" --batch-size 5 --timed-steps 256 > $OUT/dense.txt 2>&1
timeout 110 "${B[@]}" --append --sparse-method fp8_kv --batch-size 5,max --timed-steps 64 > $OUT/fp8.txt 2>&1
timeout 110 "${B[@]}" --append --sparse-method kivi --kivi-bits 4 --batch-size 5,max --timed-steps 48 > $OUT/kivi4.txt 2>&1
timeout 120 "${B[@]}" --append --sparse-method kivi --kivi-bits 2 --batch-size 5,max --timed-steps 32 > $OUT/kivi2.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 5 > $OUT/summary.txt
timeout 100 "${B[@]}" --append --sparse-method retroinfer --batch-size 5 --timed-steps 2040 > $OUT/retro.txt 2>&1
timeout 90 "${B[@]}" --append --sparse-method turboquant --turboquant-bits 3 --batch-size max --timed-steps 16 > $OUT/tq3.txt 2>&1
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 8 > $OUT/summary.txt; cat $OUT/summary.txt
grep -E "^\| " $OUT/engine/bench.md | head -30
(cd $OUT && tar czf engine.tgz engine *.txt && rm -rf engine dense.txt fp8.txt kivi4.txt kivi2.txt retro.txt tq3.txt)
