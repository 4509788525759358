#!/usr/bin/env bash
# Session 29 call 3 (issue 17): Quest-2048, OmniKV-2048 and RetroInfer (defaults) against dense at batch 5, 128K,
# 256 timed steps, profiled, at this session's final kernels (the three-launch cluster selection).
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
COMMIT=$C timeout 420 bash results/bench/run_h200_query_aware.sh $OUT/qa "quest omnikv retroinfer" > $OUT/log.txt 2>&1
grep "^| \(dense\|quest\|omnikv\|retro\)" $OUT/qa/bench.md | cut -c1-220; grep -E "ms/step|_kernel" $OUT/log.txt | head -60
