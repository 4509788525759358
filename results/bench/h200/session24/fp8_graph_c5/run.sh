#!/usr/bin/env bash
# Session 24 call 5: fp8_kv at batch 11 with max_num_seqs 11, so its decode graph is captured for 11 rows (with 64,
# batch 11 replays the 16-row graph, whose split count is sized for 16 requests: 33 splits instead of 48).
OUT=$1; C=$2
mkdir -p $OUT
timeout 100 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 \
  --max-num-seqs 11 --sparse-method fp8_kv --batch-size 11 --profile-steps 3 --timed-steps 32 --out $OUT/fp8 > $OUT/fp8.txt 2>&1
python3 results/bench/engine_summary.py $OUT/fp8/bench.json --kernels 4; tail -3 $OUT/fp8.txt
(cd $OUT && tar czf fp8.tgz fp8 && rm -rf fp8)
