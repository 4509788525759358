#!/usr/bin/env bash
# Session 21 call 5: is RetroInfer's index-update step slow only the first time in a process (kernel compiles)?
# Batch 4, 128K in, 4K planned out, 2100 timed steps: updates near steps 1019 and 2043.
set -x
OUT=$1; C=$2
mkdir -p $OUT
B=(bench --no-progress --prompt-len 131072 --output-len 4096 --batch-size 4)
E=(--commit "$C" --out $OUT/engine)
timeout 170 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --sparse-method retroinfer --timed-steps 2100 --max-num-seqs 8 > $OUT/retro.txt 2>&1
tail -2 $OUT/retro.txt
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 0
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
