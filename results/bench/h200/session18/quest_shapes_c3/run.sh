#!/usr/bin/env bash
# Session 18 call 3: graph-timed launch shapes of the int8 page bounds (byte permutes, bf16 out) and bf16 top-k
# variants at the Quest shape, then dense / Quest-2048 (defaults) / Quest-2048 with the probe's best shapes
# patched in, 128K, batch 5, side by side.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 150 python3 benchmarks/quest_select_probe.py --batches 5,10 --no-sweep --codes-graph-sweep \
  --top-k-variants "serial (default),packed b2 t2048,packed b2 t8192,packed b2 one w32,packed b2 one w16,packed b2 one w8,packed b4" \
  --json $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "page_bounds|graph|top-k|Error|error" $OUT/probe.txt | head -60
python3 pick.py $OUT/probe.json $OUT/best.json
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
W=(python3 benchwrap.py bench --no-progress --commit "$C+best" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 100 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 90 "${B[@]}" --append "${Q[@]}" --batch-size 5 > $OUT/quest.txt 2>&1; tail -1 $OUT/quest.txt
BEST_JSON=$OUT/best.json timeout 90 "${W[@]}" --append "${Q[@]}" --batch-size 5 > $OUT/quest_best.txt 2>&1; head -1 $OUT/quest_best.txt; tail -1 $OUT/quest_best.txt
grep -E "^\| (dense|quest)" $OUT/engine/bench.md
python3 - <<PY
import json, statistics as st
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        ms = [x * 1e3 for x in raw["step_seconds"]]
        print(r["sparse_method"], inv.get("environment", {}).get("commit"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "GB/step", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"), "step mean/median", round(st.mean(ms), 3), round(st.median(ms), 3), "long", [(i, round(x, 1)) for i, x in enumerate(ms) if x > 1.5 * st.median(ms)], "stalls", raw.get("stalls"))
        for k in raw.get("gpu_kernels_top", [])[:12]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
cd $OUT && tar czf engine.tgz engine && rm -rf engine
