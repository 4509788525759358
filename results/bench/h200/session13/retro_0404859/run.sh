#!/usr/bin/env bash
# Session 13 call 5: RetroInfer (count selection, budget ordered) at batch 5 / 128K next to dense, collections logged; quality.
set -x
OUT=$1; C=$2
mkdir -p $OUT
A=(--no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8)
timeout 45 python3 "$(dirname "$0")/gclog.py" $OUT/gc_dense.json bench "${A[@]}" --out $OUT/b5 --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/dense_log.txt 2>&1; tail -1 $OUT/dense_log.txt
timeout 90 python3 "$(dirname "$0")/gclog.py" $OUT/gc_retro.json bench "${A[@]}" --out $OUT/b5 --append --sparse-method retroinfer --batch-size 5 --timed-steps 64 --profile-steps 3 > $OUT/retro_log.txt 2>&1; tail -3 $OUT/retro_log.txt | cut -c1-300
grep "^|" $OUT/b5/bench.md | head -6
python3 - <<PY
import json, statistics
d = json.load(open("$OUT/b5/bench.json"))
for inv, name in zip(d["invocations"], ("dense", "retro")):
    ev = json.load(open(f"$OUT/gc_{name}.json"))
    for r in inv["runs"]:
        raw = r["raw"]; s = raw["step_seconds"]; ends = raw["step_end_unix"]
        print(r["sparse_method"], "median", round(statistics.median(s) * 1e3, 2), "mean", round(sum(s) / len(s) * 1e3, 2), "wall", raw["wall_seconds"], "busy", raw.get("gpu_kernel_ms_per_step"))
        print("  steps ms", [round(x * 1e3, 1) for x in s])
        lo, hi = ends[0] - s[0] - 1, ends[-1] + 0.1
        print("  collections in the timed window (unix, gen, ms):", [(round(t - lo, 3), g, round(ms, 1)) for t, g, ms in ev if lo <= t <= hi])
        print("  collections overall:", len(ev), "gen2:", sum(1 for e in ev if e[1] == 2), "max ms", max([e[2] for e in ev] or [0]))
        print("  step ends rel:", [round(t - lo, 3) for t in ends])
        for k in raw.get("gpu_kernels_top", [])[:14]:
            print("   ", k["name"][:70], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
timeout 170 python3 scripts/eval_kv_dtypes.py --set retroinfer --chunk 2048 --device cuda --samples-per-cell 8 --stores dense,retroinfer-0.018+0.232 --out $OUT/quality > $OUT/quality_log.txt 2>&1; tail -6 $OUT/quality_log.txt | cut -c1-400
