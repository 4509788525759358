#!/usr/bin/env bash
# Session 14 call 1: a whole decode step from the kernels with the overlap switches swept, then the engine
# (SnapKV-8192 and dense at batch 5, 128K) with the switches on and off, then the touched kernels' GPU tests.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/smi.txt 2>&1
cd packages/sparse-kernels/benchmarks && timeout 230 python3 decode_step_probe.py --batch 5 --kv-len 8192,131072 --prefetch-mb 0,4,8,16 --json $OUT/step_probe.json > $OUT/step_probe.txt 2>&1; cd - >/dev/null; cat $OUT/step_probe.txt | grep -v Warn
B=(bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5 --profile-steps 3)
S=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 70 python3 switches.py 1 8 "${B[@]}" "${S[@]}" --timed-steps 256 --out $OUT/on > $OUT/snap_on.txt 2>&1; tail -2 $OUT/snap_on.txt
timeout 70 python3 switches.py 0 0 "${B[@]}" "${S[@]}" --timed-steps 256 --out $OUT/off > $OUT/snap_off.txt 2>&1; tail -2 $OUT/snap_off.txt
timeout 60 python3 switches.py 1 8 "${B[@]}" --timed-steps 64 --out $OUT/on --append > $OUT/dense_on.txt 2>&1; tail -2 $OUT/dense_on.txt
timeout 60 python3 switches.py 0 0 "${B[@]}" --timed-steps 64 --out $OUT/off --append > $OUT/dense_off.txt 2>&1; tail -2 $OUT/dense_off.txt
grep "^|" $OUT/on/bench.md $OUT/off/bench.md | grep -v -- "---"
python3 - <<PY
import json
for tag in ("on", "off"):
    try:
        d = json.load(open(f"$OUT/{tag}/bench.json"))
    except Exception as e:
        print(tag, e); continue
    for inv in d["invocations"]:
        for r in inv["runs"]:
            raw = r["raw"]
            print(tag, r["sparse_method"], raw["batch_size"], "ms", round(r["metrics"]["ms_per_step"], 3), "median", round(r["metrics"]["ms_per_step_median"], 3), "busy", raw.get("gpu_kernel_ms_per_step"))
            for k in raw.get("gpu_kernels_top", [])[:9]:
                print("   ", k["name"][:60], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
timeout 150 python3 -m pytest -q -x packages/sparse-kernels/tests/test_linear.py packages/sparse-kernels/tests/test_rms_norm.py packages/sparse-kernels/tests/test_silu_mul.py packages/sparse-kernels/tests/test_rope.py packages/sparse-kernels/tests/test_kv_store.py packages/sparse-kernels/tests/test_cuda_graph.py packages/sparse-kernels/tests/test_gpu_kernels.py > $OUT/gpu_tests.txt 2>&1; tail -5 $OUT/gpu_tests.txt
