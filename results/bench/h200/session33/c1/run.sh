#!/usr/bin/env bash
# Session 31 call 1 (issue 17): RetroInfer's int8 centroid codes, Quest's heads-together page bounds and
# RetroInfer's picks in one launch, each A/B in one call: kernel probes first, then the engine at batch 5 x 128K
# (dense, Quest-2048 default / heads-together, RetroInfer default / int8 centroids / one-launch picks).
# Not run in session 31 (no device was lent); from the repository root with the packages importable:
# bash run.sh OUT COMMIT
set -x
OUT=$1; C=$2; D=results/bench/h200/session31/c1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 50 python3 $D/logits_probe.py > $OUT/logits_probe.txt 2>&1
timeout 80 python3 benchmarks/quest_select_probe.py --batches 5 --no-sweep --page-bounds-only --json $OUT/quest_probe.json > $OUT/quest_probe.txt 2>&1
timeout 40 python3 benchmarks/retroinfer_kernel_probe.py --part picks --sweep none > $OUT/retro_probe.txt 2>&1
COMMIT=$C timeout 400 bash results/bench/run_h200_query_aware.sh $OUT/qa "quest quest_together retroinfer retroinfer_int8 retroinfer_one" > $OUT/log.txt 2>&1
grep "^| \(dense\|quest\|omnikv\|retro\)" $OUT/qa/bench.md | cut -c1-200; grep -E "ms/step|_kernel" $OUT/log.txt | head -80
