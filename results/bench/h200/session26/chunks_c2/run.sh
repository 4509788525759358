#!/usr/bin/env bash
# Session 26 call 2: the 128K dense prefill with warm cuDNN plans at chunk 2048 / 4096 / 8192 (each: a cold
# prefill, then a warm one), and at 2048 a third one under the profiler (GPU busy time against wall time).
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
A=(bench --no-progress --commit "$C" --out $OUT/pf --prefill real --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8)
PROF_OUT=$OUT/prof2048.json timeout 200 python3 $(dirname $0)/prefwrap.py "${A[@]}" --prompt-len 131072,131072,131072 > $OUT/logs/c2048.txt 2>&1
grep PROFILED $OUT/logs/c2048.txt
for c in 4096 8192; do
  timeout 150 python3 -m sparse_serve.cli "${A[@]}" --append --prompt-len 131072,131072 --max-num-batched-tokens $c > $OUT/logs/c$c.txt 2>&1
done
grep -A12 "^## Prefill" $OUT/pf/bench.md
(cd $OUT && tar czf pf.tgz pf logs && rm -rf pf logs)
