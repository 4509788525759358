#!/usr/bin/env bash
# Session 18 call 2: page bounds over int8 codes converted by byte permutes (PRMT) + bf16 bounds / top-k.
# GPU tests (page bounds, summary codes, bf16 top-k, Quest / OmniKV engine paths, CUDA engine, MLA Quest),
# the selection probe (graph-timed page bounds cvt / prmt, chains), then dense / Quest-2048 / Quest-2048 over
# fp8 at 128K, batch 5, side by side.
set -x
OUT=$1; C=$2
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider packages/sparse-kernels/tests/test_page_bounds.py \
  packages/sparse-kernels/tests/test_summary_codes.py tests/test_cuda_engine.py tests/test_mla_quest.py \
  "packages/sparse-kernels/tests/test_top_k_ascending.py::test_bfloat16_scores_equal_a_stable_sort" \
  tests/test_quantized_kv_engine.py tests/test_bench_stalls.py -k "not variants_property and (bfloat16 or allocator or page_bounds or bound or summar or cuda or quest or omnikv or graph or code)" > $OUT/gpu_tests.txt 2>&1
tail -6 $OUT/gpu_tests.txt
timeout 100 python3 benchmarks/quest_select_probe.py --batches 5,10 --no-sweep --top-k-variants "serial (default)" --json $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "page_bounds|graph|top-k|Error|error" $OUT/probe.txt | head -40
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 --timed-steps 256 --max-num-seqs 64 --profile-steps 3 --out $OUT/engine)
Q=(--sparse-method quest --sink-keep-tokens 64 --decode-keep-tokens 1472 --recent-keep-tokens 512)
timeout 100 "${B[@]}" --batch-size 5 > $OUT/dense.txt 2>&1; tail -1 $OUT/dense.txt
timeout 90 "${B[@]}" --append "${Q[@]}" --batch-size 5 > $OUT/quest.txt 2>&1; tail -1 $OUT/quest.txt
timeout 90 "${B[@]}" --append "${Q[@]}" --kv-cache-dtype fp8 --batch-size 5 > $OUT/quest_fp8.txt 2>&1; tail -1 $OUT/quest_fp8.txt
grep -E "^\| (dense|quest)" $OUT/engine/bench.md
python3 - <<PY
import json, statistics as st
d = json.load(open("$OUT/engine/bench.json"))
for inv in d["invocations"]:
    for r in inv["runs"]:
        raw, m = r["raw"], r["metrics"]
        ms = [x * 1e3 for x in raw["step_seconds"]]
        print(r["sparse_method"], r.get("kv_store"), raw.get("batch_size"), "ms/step", round(m["ms_per_step"], 3), "tok/s", round(m["tokens_per_s"], 1), "GB/step", round(m["bytes_per_step"] / 1e9, 2), "copy", round(m.get("fraction_of_copy_bw", 0), 3), "busy", raw.get("gpu_kernel_ms_per_step"), "graphs", raw.get("cuda_graph_steps"), "step mean/median", round(st.mean(ms), 3), round(st.median(ms), 3), "long", [(i, round(x, 1)) for i, x in enumerate(ms) if x > 1.5 * st.median(ms)], "stalls", raw.get("stalls"))
        for k in raw.get("gpu_kernels_top", [])[:12]:
            print("   ", k["name"][:50], round(k["ms_per_step"], 4), k.get("calls_per_step"))
PY
cd $OUT && tar czf engine.tgz engine && rm -rf engine
