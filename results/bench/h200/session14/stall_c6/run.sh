#!/usr/bin/env bash
# Session 14 call 6: what stalls Quest-2048's host at batch 5 / 128K (its 19-26 ms steps among ~8 ms).
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 100 python3 stalllog.py $OUT/events.json bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --timed-steps 256 --out $OUT/q > $OUT/quest.txt 2>&1; tail -2 $OUT/quest.txt
python3 - <<PY
import json
d = json.load(open("$OUT/q/bench.json")); ev = json.load(open("$OUT/events.json"))
r = d["invocations"][0]["runs"][0]; raw = r["raw"]; s = raw["step_seconds"]; ends = raw["step_end_unix"]
med = sorted(s)[len(s) // 2]
print("median ms", round(med * 1e3, 2), "mean", round(sum(s) / len(s) * 1e3, 2))
lo = ends[0] - s[0]
print("long steps (index, ms, start rel s):", [(i, round(x * 1e3, 1), round(ends[i] - x - lo, 3)) for i, x in enumerate(s) if x > 1.5 * med])
print("events in the window (rel s, kind, name, ms):", [(round(t - lo, 3), k, n, round(ms, 1)) for t, k, n, ms in ev if lo - 0.05 <= t <= ends[-1] + 0.05])
print("events overall by kind:", {k: sum(1 for e in ev if e[1] == k) for k in set(e[1] for e in ev)})
PY
