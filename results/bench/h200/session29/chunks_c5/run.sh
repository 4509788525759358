#!/usr/bin/env bash
# Session 29 call 5 (issue 16): the 128K dense prefill (batch 1, real prefill) by chunk size, now that each chunk's
# causal square runs in cuDNN: HF transformers and the engine at chunk 2048 in one process, then chunk
# 131072 (the whole prompt: one causal cuDNN call a layer).
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
A=(bench --no-progress --commit "$C" --out $OUT/pf --prefill real --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8 --prompt-len 131072)
timeout 190 python3 -m sparse_serve.cli "${A[@]}" --hf-baseline --hf-steps 2 > $OUT/logs/c2048_hf.txt 2>&1
tail -1 $OUT/logs/c2048_hf.txt
for c in 131072; do
  timeout 170 python3 -m sparse_serve.cli "${A[@]}" --append --max-num-batched-tokens $c > $OUT/logs/c$c.txt 2>&1
  tail -3 $OUT/logs/c$c.txt | cut -c1-300
done
grep -A8 "^## Prefill" $OUT/pf/bench.md | cut -c1-220
