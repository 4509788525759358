#!/usr/bin/env bash
# Session 33 call 3 (issue 17's closing numbers, at the defaults session 33's call 1 chose: RetroInfer's int8
# centroid codes and one-launch picks): dense, Quest-2048 and OmniKV-2048 over the model dtype and over fp8,
# RetroInfer at its defaults and with model-dtype centroids, all at batch 5 x 128K in one call, with the per-step
# kernel profile of each (engine_summary.py). From the repository root with the packages importable:
# bash run.sh OUT COMMIT
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
COMMIT=$C timeout 540 bash results/bench/run_h200_query_aware.sh $OUT/qa "quest omnikv retroinfer quest_fp8 omnikv_fp8 retroinfer_model" > $OUT/log.txt 2>&1
grep "^| \(dense\|quest\|omnikv\|retro\)" $OUT/qa/bench.md | cut -c1-200; grep -E "ms/step|_kernel" $OUT/log.txt | head -100
