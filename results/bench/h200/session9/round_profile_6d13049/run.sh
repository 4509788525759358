#!/usr/bin/env bash
# Session 9 call 4: where a decode-time eviction round's time goes on the H200: the profiled window (8 steps after
# 250 timed ones) contains the eviction step; batch 5 under cProfile (host), batch 91 (device kernels).
set -x
OUT=$1; C=$2
mkdir -p $OUT
B=(-m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 --decode-eviction-interval 256 --timed-steps 250 --profile-steps 8 --max-num-seqs 192)
timeout 100 python3 -m cProfile -o $OUT/b5.prof "${B[@]}" --out $OUT/round --batch-size 5 > $OUT/log.txt 2>&1
python3 -c "import pstats; pstats.Stats('$OUT/b5.prof').sort_stats('cumulative').print_stats('sparse_', 40)" > $OUT/b5_prof.txt 2>&1; rm -f $OUT/b5.prof
grep -v "^\s*$" $OUT/b5_prof.txt | head -60
timeout 120 python3 "${B[@]}" --out $OUT/round --append --batch-size max >> $OUT/log.txt 2>&1
python3 - <<PY
import json
d = json.load(open("$OUT/round/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw = r["raw"]
        print(raw["batch_size"], "busy ms/step over 8 profiled steps", raw.get("gpu_kernel_ms_per_step"), "steps", raw.get("profiled_steps"))
        for k in raw.get("gpu_kernels_top", []):
            print("   ", round(k["ms_per_step"], 3), k["calls_per_step"], k["name"][:90])
PY
