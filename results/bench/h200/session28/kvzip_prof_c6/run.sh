#!/usr/bin/env bash
# Session 28 call 6: where KVzip's 32K prefill goes (host cProfile of the whole bench process; real prefill, chunk 4096).
OUT=$1; C=$2
mkdir -p $OUT
K=(bench --no-progress --commit "$C" --prompt-len 32768 --output-len 16 --batch-size 1 --prefill real --max-num-batched-tokens 4096 --max-num-seqs 8 --out $OUT/kvzip --tokenizer packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval --sparse-method kvzip)
timeout 150 python3 -m cProfile -o $OUT/kvzip.prof -m sparse_serve.cli "${K[@]}" > $OUT/log.txt 2>&1
grep -A4 "^## Prefill" $OUT/kvzip/bench.md | tail -1 | cut -c1-120
python3 -c "
import pstats; s=pstats.Stats('$OUT/kvzip.prof'); s.sort_stats('cumulative').print_stats(45)" | grep -v "^$" | cut -c1-190 | tail -48
python3 -c "
import pstats; s=pstats.Stats('$OUT/kvzip.prof'); s.sort_stats('tottime').print_stats(20)" | grep -v "^$" | cut -c1-190 | tail -22
