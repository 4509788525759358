#!/usr/bin/env bash
# Session 28 call 5 (issue 17): Quest-2048, OmniKV-2048 and RetroInfer (defaults) against dense at batch 5, 128K, 256 timed steps.
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
COMMIT=$C bash results/bench/run_h200_query_aware.sh $OUT/qa "quest omnikv retroinfer" > $OUT/log.txt 2>&1
