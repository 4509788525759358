#!/usr/bin/env bash
# Session 22 call 1: RetroInfer's index update off the host (graphed k-means per block shape, batched arena
# writes): native GPU tests, the update probe (eager vs graphed, batch 5 and 1), dense 256 steps then RetroInfer
# 1100 steps (one index update) at 128K x 5.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_cluster_index_graphs.py \
  packages/sparse-methods/tests/test_cluster_arena.py tests/test_retroinfer_engine.py > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
for r in 5 1; do timeout 60 python3 -u benchmarks/retroinfer_update_cost.py --device cuda --requests $r --reps 36 > $OUT/update_r$r.txt 2>&1; cat $OUT/update_r$r.txt; done
B=(bench --no-progress --prompt-len 131072 --output-len 2048 --batch-size 5)
E=(--commit "$C" --profile-steps 3 --out $OUT/engine)
timeout 70 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --timed-steps 256 --max-num-seqs 64 > $OUT/dense.txt 2>&1
timeout 130 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --append --sparse-method retroinfer --timed-steps 1100 --max-num-seqs 8 > $OUT/retro.txt 2>&1
tail -2 $OUT/retro.txt
python3 results/bench/engine_summary.py $OUT/engine/bench.json --kernels 20
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        st = r["raw"]["step_seconds"]
        big = sorted(range(len(st)), key=lambda i: -st[i])[:5]
        print(r["sparse_method"], "longest host steps (index, ms):", [(i, round(st[i] * 1e3, 1)) for i in big])
PY
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
