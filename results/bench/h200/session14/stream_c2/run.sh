#!/usr/bin/env bash
# Session 14 call 2: the residual stream (norms and SiLU*mul inside the projections) in a whole decode step
# from the kernels and in the engine: SnapKV-8192 and dense at batch 5 / 128K over the whole 2K decode, and
# the separate kernels beside them; the fused-linear GPU tests.
set -x
OUT=$1; C=$2
mkdir -p $OUT
cd packages/sparse-kernels/benchmarks
timeout 100 python3 decode_step_probe.py --batch 5 --kv-len 8192 --per-sm 8,4 --json $OUT/step_probe_8k.json > $OUT/step_probe.txt 2>&1
timeout 100 python3 decode_step_probe.py --batch 5 --kv-len 131072 --per-sm 8 --json $OUT/step_probe_128k.json >> $OUT/step_probe.txt 2>&1
cd - >/dev/null; grep -v -i warn $OUT/step_probe.txt
B=(bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 3)
S=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 100 python3 switches.py 1 8 "${B[@]}" "${S[@]}" --timed-steps 2040 --out $OUT/stream > $OUT/snap_stream.txt 2>&1; tail -1 $OUT/snap_stream.txt
timeout 130 python3 switches.py 1 8 "${B[@]}" --timed-steps 2040 --out $OUT/stream --append > $OUT/dense_stream.txt 2>&1; tail -1 $OUT/dense_stream.txt
timeout 70 python3 switches.py 0 8 "${B[@]}" "${S[@]}" --timed-steps 512 --out $OUT/plain > $OUT/snap_plain.txt 2>&1; tail -1 $OUT/snap_plain.txt
timeout 60 python3 switches.py 0 8 "${B[@]}" --timed-steps 128 --out $OUT/plain --append > $OUT/dense_plain.txt 2>&1; tail -1 $OUT/dense_plain.txt
grep "^|" $OUT/stream/bench.md $OUT/plain/bench.md | grep -v -- "---"
grep -h "vs dense\|x\*\*" $OUT/stream/bench.md | head
python3 - <<PY
import json, statistics
for tag in ("stream", "plain"):
    try:
        d = json.load(open(f"$OUT/{tag}/bench.json"))
    except Exception as e:
        print(tag, e); continue
    for inv in d["invocations"]:
        for r in inv["runs"]:
            raw = r["raw"]; s = raw["step_seconds"]; m = r["metrics"]
            print(tag, r["sparse_method"], raw["batch_size"], "steps", len(s), "ms", round(m["ms_per_step"], 3), "median", round(m["ms_per_step_median"], 3), "first256", round(sum(s[:256]) / min(256, len(s)) * 1e3, 3), "tok/s", round(m["tokens_per_s"], 1), "copy", round(m["fraction_of_copy_bw"], 3), "busy", raw.get("gpu_kernel_ms_per_step"), "long steps", sorted(round(x * 1e3, 1) for x in s)[-5:])
            for k in raw.get("gpu_kernels_top", [])[:9]:
                print("   ", k["name"][:60], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
timeout 100 python3 -m pytest -q packages/sparse-kernels/tests/test_fused_linear.py packages/sparse-kernels/tests/test_linear.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
