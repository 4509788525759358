#!/usr/bin/env bash
# Session 17 call 2: Quest-2048 over every store at 128K, side by side with dense in one run, each at batch 5
# (dense's largest) and at its own largest batch, profiled (3 steps): bf16 (int8 summaries), fp8 (int8
# summaries), KIVI-4 and KIVI-2 with 16-token pages (the pages' key statistics as summaries).
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 120 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 100 "${B[@]}" --append "${Q[@]}" --batch-size 5 > $OUT/quest.txt 2>&1; tail -1 $OUT/quest.txt
timeout 150 "${B[@]}" --append "${Q[@]}" --kv-cache-dtype fp8 --batch-size 5,max > $OUT/quest_fp8.txt 2>&1; tail -1 $OUT/quest_fp8.txt
timeout 150 "${B[@]}" --append "${Q[@]}" --kv-cache-dtype kivi --kivi-bits 4 --kv-quant-page-size 16 --batch-size 5,max > $OUT/quest_kivi4.txt 2>&1; tail -1 $OUT/quest_kivi4.txt
timeout 150 "${B[@]}" --append "${Q[@]}" --kv-cache-dtype kivi --kivi-bits 2 --kv-quant-page-size 16 --batch-size max > $OUT/quest_kivi2.txt 2>&1; tail -1 $OUT/quest_kivi2.txt
grep -E "^\| (dense|quest)" $OUT/engine/bench.md
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        print(r["sparse_method"], r.get("kv_cache_dtype"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "GB/step", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"), "graphs", raw.get("cuda_graph_steps"))
        for k in raw.get("gpu_kernels_top", [])[:10]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
cd $OUT && tar czf engine.tgz engine && rm -rf engine
