#!/usr/bin/env bash
# Final H200 call of session 3: CUDA check of the last changes, issue 5's query-aware run with real block
# summaries, issue 6's long agent run; all at one commit unpacked from git archive.
set -uo pipefail
COMMIT=$1; OUT=$2
SRC=/tmp/src; mkdir -p $SRC; tar -xf .final/src.tar -C $SRC; cd $SRC
export PYTHONPATH=/tmp/site:$(ls -d $SRC/packages/*/src | tr '\n' ':')$SRC/tests
R=$OUT/r; mkdir -p $R
say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a $R/log.txt; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 1000 > $R/clocks.csv 2>&1 &
SMI=$!
say "cuda tests"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py -k "eviction or query_aware or graphs_equal" > $R/tests_cuda.txt 2>&1
say "cuda tests rc=$? $(tail -1 $R/tests_cuda.txt)"
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$COMMIT")
say dense
timeout 70 "${B[@]}" --out $R/qa --prompt-len 131072 --batch-size max --output-len 2048 --timed-steps 48 --profile-steps 3 --max-num-seqs 8 >> $R/log.txt 2>&1
say "dense rc=$?"
for M in quest omnikv; do
  timeout 60 "${B[@]}" --out $R/qa --append --sparse-method $M --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 \
    --prompt-len 131072 --batch-size 5 --output-len 2048 --timed-steps 48 --profile-steps 3 --max-num-seqs 8 >> $R/log.txt 2>&1
  say "$M rc=$?"
done
say agent
COMMIT=$COMMIT bash results/agent/run_h200.sh $R/agent long >> $R/log.txt 2>&1
say "agent rc=$?"
kill $SMI
cd $OUT && tar -czf final.tar.gz r && cp r/log.txt log.txt
