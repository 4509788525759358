#!/usr/bin/env bash
# Session 27 call 5 (issue 16): the dense prefill at 128K, 32K and 8K side by side with HF transformers in one
# process, after the bench's warm-up compiles every cascade path (call 4's 32K, first in its process, paid the
# square-and-prefix merge's compilation: 1.65 s); then 128K without the squares (sqwrap.py) after the same warm-up.
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
A=(bench --no-progress --commit "$C" --out $OUT/pf --prefill real --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8)
timeout 240 python3 -m sparse_serve.cli "${A[@]}" --prompt-len 131072,32768,8192 --hf-baseline --hf-steps 2 > $OUT/logs/sq_hf.txt 2>&1
tail -1 $OUT/logs/sq_hf.txt
timeout 100 python3 sqwrap.py "${A[@]}" --commit "$C+nosquares" --append --prompt-len 131072 > $OUT/logs/nosq.txt 2>&1
tail -1 $OUT/logs/nosq.txt
grep -A12 "^## Prefill" $OUT/pf/bench.md
(cd $OUT && tar czf pf.tgz pf logs && rm -rf pf logs)
