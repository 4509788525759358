#!/usr/bin/env bash
# Session 19 call 4 (trimmed to the device time left: no sampler, no OmniKV over fp8; RetroInfer 600 steps): GPU tests (fused decode reduce, logits_out, RetroInfer graphs); the whole-step probe with the
# reduce fused or launched (2K, 8K, 128K x 5); RetroInfer's long decode step. (a) the stall sampler with the old width (WIDTH_QUANTUM 1: the width
# grows 16 slots every ~890 tokens), 150 timed steps (the width changes at decode step 116); (b) dense, then RetroInfer
# with the 256-slot width, 1200 timed steps (two index updates), 128K x 5; then Quest-2048, OmniKV-2048 over bf16 and fp8
# (256 steps) beside the same dense run.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 80 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_triton_decode.py packages/sparse-kernels/tests/test_decode_lse.py \
  packages/sparse-kernels/tests/test_decode_logits.py packages/sparse-kernels/tests/test_cuda_graph.py tests/test_retroinfer_engine.py > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
(cd packages/sparse-kernels/benchmarks && timeout 75 python3 decode_step_probe.py --batch 5 --kv-len 2048,8192,131072 --per-sm 4 --json $OUT/step_probe.json) > $OUT/step_probe.txt 2>&1
cat $OUT/step_probe.txt
B=(bench --no-progress --prompt-len 131072 --output-len 2048 --max-num-seqs 8 --batch-size 5)
E=(--commit "$C" --timed-steps 600 --profile-steps 3 --max-num-seqs 64 --out $OUT/engine)
timeout 70 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --timed-steps 256 > $OUT/dense.txt 2>&1
timeout 120 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --append --sparse-method retroinfer --max-num-seqs 8 > $OUT/retro.txt 2>&1
Q=(--sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512 --timed-steps 256 --max-num-seqs 64)
timeout 60 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --append --sparse-method quest "${Q[@]}" > $OUT/quest.txt 2>&1
timeout 60 python3 -m sparse_serve.cli "${B[@]}" "${E[@]}" --append --sparse-method omnikv "${Q[@]}" > $OUT/omnikv.txt 2>&1
grep -E "^\| (dense|retro|quest|omni)" $OUT/engine/bench.md
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        st = raw["step_seconds"]; med = sorted(st)[len(st)//2]
        print(r["sparse_method"], "ms/step", round(m["ms_per_step"], 3), "median", round(med*1e3, 2), "tok/s", round(m["tokens_per_s"], 1), "busy", raw.get("gpu_kernel_ms_per_step"), "GB", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "long", [(i, round(s*1e3)) for i, s in enumerate(st) if s > 2*med])
        for k in raw.get("gpu_kernels_top", [])[:10]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
(cd $OUT && tar czf engine.tgz engine && rm -rf engine)
