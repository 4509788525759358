#!/usr/bin/env bash
# Session 25 call 5 (issue 16 status): dense prefill at 128K and 32K, batch 1, chunk 2048, against HF transformers
# (sdpa) in the same process, at this session's head (rope_store also fuses RoPE with the store in prefill chunks).
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 400 python3 -m sparse_serve.cli bench --no-progress --commit "$C" --out $OUT/prefill --prefill real \
  --prompt-len 131072,32768 --batch-size 1 --output-len 16 --warmup-steps 3 --max-num-seqs 8 --hf-baseline --hf-steps 8 \
  > $OUT/prefill.txt 2>&1
grep -iE "prefill|hf" $OUT/prefill/bench.md | head -20; tail -3 $OUT/prefill.txt
(cd $OUT && tar czf prefill.tgz prefill prefill.txt && rm -rf prefill prefill.txt)
