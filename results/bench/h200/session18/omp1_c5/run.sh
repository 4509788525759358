#!/usr/bin/env bash
# Session 18 call 5 (warm machine): the same bench with torch's CPU ops on one thread (OMP_NUM_THREADS=1):
# Quest-2048 under the stall sampler, then dense, 128K, batch 5.
set -x
OUT=$1; C=$2
mkdir -p $OUT
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
B=(bench --no-progress --commit "$C+omp1" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
OMP_NUM_THREADS=1 timeout 85 python3 benchmarks/stall_sampler.py --interval-ms 1 --factor 1.6 -- "${B[@]}" "${Q[@]}" --batch-size 5 > $OUT/quest.txt 2>&1
sed -n "/== engine/,\$p" $OUT/quest.txt | grep -E "^step|== engine" | head -20
OMP_NUM_THREADS=1 timeout 85 python3 -m sparse_serve.cli "${B[@]}" --append --batch-size 5 > $OUT/dense.txt 2>&1
grep -E "^\| (dense|quest)" $OUT/engine/bench.md
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
