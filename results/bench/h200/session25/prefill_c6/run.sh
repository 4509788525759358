#!/usr/bin/env bash
# Session 25 call 6: the 128K dense prefill alone in its process (no HF model beside it), batch 1, chunk 2048, one
# profiled chunk, at 19d8726 (rope_store) and at f1beae9 (old/: `git archive f1beae9 packages | tar -x -C old`).
# diag6.py (run before it, same machine kind): cuDNN fused attention available, attention_with_lse 675 TFLOP/s.
OUT=$1
mkdir -p $OUT
A=(bench --no-progress --prefill real --prompt-len 131072 --batch-size 1 --output-len 4 --max-num-seqs 8 --warmup-steps 1 --profile-prefill)
NEW=$(ls -d $PWD/packages/*/src | tr '\n' ':'); OLD=$(ls -d $PWD/old/packages/*/src | tr '\n' ':')
PYTHONPATH=/tmp/site:$NEW timeout 70 python3 -m sparse_serve.cli "${A[@]}" --commit 19d8726 --out $OUT/new > $OUT/new.txt 2>&1
PYTHONPATH=/tmp/site:$OLD timeout 70 python3 -m sparse_serve.cli "${A[@]}" --commit f1beae9 --out $OUT/old > $OUT/old.txt 2>&1
grep -h "^| dense" $OUT/new/bench.md $OUT/old/bench.md
(cd $OUT && tar czf p.tgz new old new.txt old.txt && rm -rf new old new.txt old.txt)
