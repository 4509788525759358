#!/usr/bin/env bash
# Session 26 call 5: where the 128K prefill's time goes after the cascade change (9a534f6): the second prefill of the
# process under the profiler (GPU busy against wall, kernels by total time), chunk 2048.
OUT=$1; C=$2
mkdir -p $OUT/logs
A=(bench --no-progress --commit "$C" --out $OUT/pf --prefill real --batch-size 1 --output-len 4 --warmup-steps 1 --max-num-seqs 8)
PROF_CALL=2 PROF_OUT=$OUT/prof2048.json timeout 200 python3 $(dirname $0)/../chunks_c2/prefwrap.py "${A[@]}" --prompt-len 131072,131072 > $OUT/logs/c2048.txt 2>&1
grep PROFILED $OUT/logs/c2048.txt; grep -A5 "^## Prefill" $OUT/pf/bench.md
python3 -c "
import json;d=json.load(open('$OUT/prof2048.json'))
for t in d['top'][:16]: print('%8.1f ms %6d  %s'%(t['ms_total'], t['calls_per_step']*d['steps'], t['name'][:90]))"
(cd $OUT && tar czf pf.tgz pf logs && rm -rf pf logs)
