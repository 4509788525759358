#!/usr/bin/env bash
# Session 18 call 4: Quest-2048 at 128K, batch 5, twice, under benchmarks/stall_sampler.py (host stacks every
# 1 ms, a CUDA event before every step), GPU clocks / power logged every 100 ms: where the intermittent
# 15-24 ms steps come from.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $OUT/clocks.csv 2>&1 &
SMI=$!
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
for i in 1 2; do
  timeout 110 python3 benchmarks/stall_sampler.py --interval-ms 1 --factor 1.6 -- bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine "${Q[@]}" --batch-size 5 $([ $i = 2 ] && echo --append) > $OUT/quest$i.txt 2>&1
  sed -n "/== engine/,\$p" $OUT/quest$i.txt | head -70
done
kill $SMI
grep -E "^\| quest" $OUT/engine/bench.md
awk -F, 'NR>1 && $2+0 < 1900 {print}' $OUT/clocks.csv | head -20
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
# The pool-size probe: fp8 at 11 and bf16 at 5, 2 layer pools (~6 GB) against 32 (~95 GB), in order / shuffled.

timeout 170 python3 packages/sparse-kernels/benchmarks/decode_pool_probe.py --jsonl $OUT/pool.jsonl > $OUT/pool.txt 2>&1
cat $OUT/pool.txt | tail -16
# Quality of Quest with bf16-ranked bounds (the composed set's Quest row: 270 prompts, paired with dense).
timeout 160 python3 scripts/eval_kv_dtypes.py --set composed --device cuda --samples-per-cell 6 --stores dense,quest --out $OUT/quality > $OUT/quality.txt 2>&1
grep "^|" $OUT/quality.txt | head -8
