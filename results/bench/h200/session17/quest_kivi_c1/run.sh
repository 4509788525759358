#!/usr/bin/env bash
# Session 17 call 1: GPU tests of Quest over KIVI (page bounds from KIVI statistics, head-sparse KIVI decode
# with tails, engine under CUDA graphs), then Qwen3-8B shape at 128K: dense, Quest-2048, Quest-2048 over
# KIVI-4 (16-token pages) side by side.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_page_bounds.py \
  packages/sparse-kernels/tests/test_quantized_decode.py tests/test_quantized_kv_engine.py \
  -k "bounds or head_sparse or levels or quest or cuda_graphs" > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 64 --max-num-seqs 64 --out $OUT/engine)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 120 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 90 "${B[@]}" --append "${Q[@]}" --batch-size 5 > $OUT/quest.txt 2>&1; tail -1 $OUT/quest.txt
timeout 200 "${B[@]}" --append "${Q[@]}" --kv-cache-dtype kivi --kivi-bits 4 --kv-quant-page-size 16 --batch-size 5,max > $OUT/quest_kivi4.txt 2>&1; tail -1 $OUT/quest_kivi4.txt
grep -E "^\| (dense|quest)" $OUT/engine/bench.md
grep -A30 "Aggregate" $OUT/engine/bench.md | head -20
python3 - <<PY
import json
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        print(r["sparse_method"], r.get("kv_cache_dtype"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "GB/step", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"), "graphs", raw.get("cuda_graph_steps"))
        for k in raw.get("gpu_kernels_top", [])[:8]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
cd $OUT && tar czf engine.tgz engine && rm -rf engine
