#!/usr/bin/env bash
# Session 19 call 2: the decode that writes logits (OmniKV's observing layers), launch shapes swept at 128K x 5
# (graph-replayed, two layer pools), then the best one in the engine: dense + OmniKV-2048 over bf16, batch 5.
set -x
OUT=$1; C=$2
mkdir -p $OUT
cd packages/sparse-kernels/benchmarks
timeout 260 python3 decode_bandwidth.py --logits --kv-len 131072 --cases 5x2 --configs $(cat ../../../cfgs.txt) --json $OUT/logits_sweep.json > $OUT/logits_sweep.txt 2>&1
tail -12 $OUT/logits_sweep.txt
cd ../../..
python3 pick2.py $OUT/logits_sweep.json $OUT/best.json
B=(bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --batch-size 5 --out $OUT/engine)
O=(--sparse-method omnikv --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 90 python3 -m sparse_serve.cli "${B[@]}" > $OUT/dense.txt 2>&1
BEST_JSON=$OUT/best.json timeout 90 python3 benchwrap2.py "${B[@]}" --append "${O[@]}" > $OUT/omnikv.txt 2>&1
head -1 $OUT/omnikv.txt
grep -E "^\| (dense|omnikv)" $OUT/engine/bench.md
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        print(r["sparse_method"], "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "busy", raw.get("gpu_kernel_ms_per_step"))
        for k in raw.get("gpu_kernels_top", [])[:8]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
