#!/usr/bin/env bash
# Session 28 call 4 (issue 15): quality of every decode method at a quarter of the embedded model's longest trained
# context (4096 tokens), 5 retrieval tasks x 9 depths x 4 samples, Wilson intervals and paired differences to dense.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
echo "commit $C" > $OUT/log.txt
timeout 480 python3 scripts/eval_kv_dtypes.py --set methods --chunk 2048 --device cuda --samples-per-cell 4 --out $OUT/methods_quality >> $OUT/log.txt 2>&1
tail -20 $OUT/log.txt | cut -c1-220
