#!/usr/bin/env bash
# Session 14 call 3: the decode split target at batch 5 (8 programs per SM, the default, against 4): the whole
# decode step from the kernels at 128K, then the engine (SnapKV-8192 over the whole 2K decode, dense, Quest-2048).
set -x
OUT=$1; C=$2
mkdir -p $OUT
cd packages/sparse-kernels/benchmarks
timeout 100 python3 decode_step_probe.py --batch 5 --kv-len 131072,8192 --per-sm 8,4 --json $OUT/step_probe.json > $OUT/step_probe.txt 2>&1
cd - >/dev/null; grep -v -i warn $OUT/step_probe.txt
B=(bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 3)
S=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
for P in 8 4; do
  timeout 100 python3 split_target.py $P "${B[@]}" "${S[@]}" --timed-steps 2040 --out $OUT/per$P $([ -f $OUT/per$P/bench.json ] && echo --append) > $OUT/snap_$P.txt 2>&1; tail -1 $OUT/snap_$P.txt
  timeout 80 python3 split_target.py $P "${B[@]}" --timed-steps 512 --out $OUT/per$P --append > $OUT/dense_$P.txt 2>&1; tail -1 $OUT/dense_$P.txt
  timeout 60 python3 split_target.py $P "${B[@]}" "${Q[@]}" --timed-steps 128 --out $OUT/per$P --append > $OUT/quest_$P.txt 2>&1; tail -1 $OUT/quest_$P.txt
done
grep "^|" $OUT/per8/bench.md $OUT/per4/bench.md | grep -v -- "---"
python3 - <<PY
import json
for tag in ("per8", "per4"):
    try:
        d = json.load(open(f"$OUT/{tag}/bench.json"))
    except Exception as e:
        print(tag, e); continue
    for inv in d["invocations"]:
        for r in inv["runs"]:
            raw = r["raw"]; s = raw["step_seconds"]; m = r["metrics"]
            print(tag, r["sparse_method"], raw["batch_size"], "steps", len(s), "ms", round(m["ms_per_step"], 3), "median", round(m["ms_per_step_median"], 3), "tok/s", round(m["tokens_per_s"], 1), "copy", round(m["fraction_of_copy_bw"], 3), "busy", raw.get("gpu_kernel_ms_per_step"), "long", sorted(round(x * 1e3, 1) for x in s)[-4:])
            for k in raw.get("gpu_kernels_top", [])[:4]:
                print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
