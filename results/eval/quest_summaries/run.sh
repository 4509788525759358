#!/usr/bin/env bash
# Session 15 call 4: quality of Quest's int8 page summaries against model-dtype ones on the embedded model (4096-token
# prompts, 5 tasks x 9 depths x 6 samples, budgets 1/4 and 1/16), two processes side by side on the GPU.
set -x
OUT=$1; C=$2
mkdir -p $OUT
E=(python3 scripts/eval_kv_dtypes.py --set quest_summaries --device cuda --samples-per-cell 6)
timeout 470 "${E[@]}" --stores dense,quest,quest-model --out $OUT/quarter > $OUT/quarter.txt 2>&1 &
timeout 470 "${E[@]}" --stores dense,quest-1/16,quest-1/16-model --out $OUT/sixteenth > $OUT/sixteenth.txt 2>&1 &
wait
tail -12 $OUT/quarter.txt; tail -12 $OUT/sixteenth.txt
