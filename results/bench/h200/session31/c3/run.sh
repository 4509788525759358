#!/usr/bin/env bash
# Prepared in session 31 (not run: no device was lent) for issue 17's closing numbers, once call 1 / 2 have chosen
# the defaults: dense, Quest-2048 and OmniKV-2048 over the model dtype and over fp8, RetroInfer at its defaults, all
# at batch 5 x 128K in one call (about 7 minutes), with the per-step kernel profile of each (engine_summary.py).
# From the repository root with the packages importable: bash run.sh OUT COMMIT
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
COMMIT=$C timeout 540 bash results/bench/run_h200_query_aware.sh $OUT/qa "quest omnikv retroinfer quest_fp8 omnikv_fp8" > $OUT/log.txt 2>&1
grep "^| \(dense\|quest\|omnikv\|retro\)" $OUT/qa/bench.md | cut -c1-200; grep -E "ms/step|_kernel" $OUT/log.txt | head -90
